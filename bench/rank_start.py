"""What starting the ranks of ``run_distributed`` costs: forked from the fork server, or spawned.

One process per start method calls ``run_distributed`` on a trivial
module-level function with world_size 2, ``--calls`` times (default 5), and
reports for each call the CPU seconds (user + system) of its whole process
tree, reaped ranks and the fork server included, and the wall seconds:

* forkserver: ``rl_e2e.distributed`` as it is (ranks forked from
  multiprocessing's fork server, torch imported there once, by the first call);
* spawn: the module as it was at ``SPAWN_COMMIT``, the last version whose
  ranks were fresh ``spawn`` processes that each imported torch, loaded from
  git into a temporary directory.

Each process imports torch and ``torch.distributed`` before its first call,
so no call carries the caller's own imports. Rounds alternate the order
(spawn first in odd rounds, forkserver first in even ones); the table gives
the first call and the mean of the later ones, each averaged over the rounds,
and the ratio forkserver / spawn; the last line the CPU seconds saved per rank
after the first call.

    python bench/rank_start.py [--calls 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPAWN_COMMIT = "b7b2cdba9bd9d6346036a4afc017ddb3a76c1b24"
WORLD_SIZE = 2
METHODS = ("spawn", "forkserver")


def _trivial(rank: int, world_size: int) -> int:
    """What each rank runs: one barrier, so a call costs little more than its start and end.

    The barrier keeps a rank of the spawn version from leaving the group while
    its peer still joins, which gloo fails on a loaded machine (today's module
    has every rank pass a barrier before ``fn``; this is a second one there).
    """
    import torch.distributed as dist

    dist.barrier()
    return rank


def _tree_cpu() -> float:
    """CPU seconds of this process and every descendant, live or reaped by its parent."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _runner(method: str, scratch: Path):
    """``run_distributed`` of ``method``: today's module, or the spawn one from git."""
    if method == "forkserver":
        from rl_e2e.distributed import run_distributed

        return run_distributed
    source = subprocess.run(
        ["git", "show", f"{SPAWN_COMMIT}:rl_e2e/distributed.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (scratch / "distributed_spawn.py").write_text(source)
    sys.path.insert(0, str(scratch))  # the spawned ranks import it by name
    from distributed_spawn import run_distributed

    return run_distributed


def measure(method: str, calls: int) -> list[tuple[float, float]]:
    """(CPU s, wall s) of each of ``calls`` runs, in this process."""
    import torch.distributed  # noqa: F401 - the caller's own imports, before the first call

    with tempfile.TemporaryDirectory(prefix="rank_start-") as scratch:
        run_distributed = _runner(method, Path(scratch))
        rows = []
        for _ in range(calls):
            cpu, wall = _tree_cpu(), time.perf_counter()
            assert run_distributed(_trivial, WORLD_SIZE, timeout_s=300) == [0, 1]
            rows.append((_tree_cpu() - cpu, time.perf_counter() - wall))
    return rows


def _child(method: str, calls: int) -> list[tuple[float, float]]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", method, "--calls", str(calls)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"{method}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5, help="calls per process (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per method (default 2)")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.calls)))
        return 0
    runs: dict[str, list[list[tuple[float, float]]]] = {method: [] for method in METHODS}
    for round_ in range(args.rounds):
        for method in METHODS if round_ % 2 == 0 else reversed(METHODS):
            runs[method].append(_child(method, args.calls))
            first, *rest = runs[method][-1]
            print(
                f"round {round_ + 1} {method}: CPU s per call "
                f"{', '.join(f'{cpu:.2f}' for cpu, _ in [first, *rest])}",
                flush=True,
            )
    table = {}
    for method, processes in runs.items():
        table[method] = [
            _mean([calls[0][0] for calls in processes]),
            _mean([_mean([cpu for cpu, _ in calls[1:]]) for calls in processes]),
            _mean([calls[0][1] for calls in processes]),
            _mean([_mean([wall for _, wall in calls[1:]]) for calls in processes]),
        ]
    print(
        f"\nworld_size {WORLD_SIZE}, {args.calls} calls per process, {args.rounds} rounds\n\n"
        "| start | CPU s, first call | CPU s, later calls | wall s, first | wall s, later |\n"
        "|---|---|---|---|---|"
    )
    for method in METHODS:
        print(f"| {method} | " + " | ".join(f"{v:.2f}" for v in table[method]) + " |")
    ratios = [fork / spawn for fork, spawn in zip(table["forkserver"], table["spawn"], strict=True)]
    print("| forkserver / spawn | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    saved = (table["spawn"][1] - table["forkserver"][1]) / WORLD_SIZE
    print(f"\nCPU s saved per rank after the first call: {saved:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
