"""What running tool calls together buys: one turn of 64 episodes whose tool sleeps 0.2 s.

Side by side, in one run, on one ``ToolExecutor`` configuration each:

* serial:     ``max_concurrency=1`` (one call at a time: 64 x 0.2 s);
* bounded 8:  ``max_concurrency=8`` (8 waves);
* concurrent: ``max_concurrency=64``, the default (what the episode loop does).

Each variant runs the same gather of 64 calls through ``ToolExecutor.call``
(argument checks, timeout wrapper, semaphore); times are medians over the
repetitions and the table prints each as a ratio to serial.

    python bench/multiturn_tools.py [--episodes 64] [--sleep 0.2] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from trainer.rollout.tools import Tool, ToolCall, ToolExecutor


class Sleep(Tool):
    name = "sleep"
    delay = 0.2

    async def execute(self, arguments, state):
        await asyncio.sleep(self.delay)
        return "done"


def one_turn(executor: ToolExecutor, episodes: int) -> float:
    async def run():
        return await asyncio.gather(
            *(executor.call(ToolCall("sleep", {}), {}) for _ in range(episodes))
        )

    t0 = time.perf_counter()
    outcomes = executor.run(run())
    wall = time.perf_counter() - t0
    assert all(o.status == "ok" for o in outcomes), outcomes
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    Sleep.delay = args.sleep
    rows = []
    for label, bound in (("serial", 1), ("bounded 8", 8), ("concurrent", args.episodes)):
        with ToolExecutor([Sleep()], timeout=60, max_concurrency=bound) as ex:
            rows.append(
                (label, statistics.median(one_turn(ex, args.episodes) for _ in range(args.reps)))
            )
    serial = rows[0][1]
    print(f"{args.episodes} calls of a tool sleeping {args.sleep:g} s, median of {args.reps}")
    print(f"{'variant':<12} {'seconds':>8} {'x serial':>9}")
    for label, wall in rows:
        print(f"{label:<12} {wall:8.3f} {wall / serial:9.4f}")


if __name__ == "__main__":
    main()
