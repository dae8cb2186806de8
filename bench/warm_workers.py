"""What starting the trainer's Ray workers costs: forked warm from a node's warm process, or cold.

For each mode, one local Ray cluster (``ray.init(address="local")``) with the
trainer's own runtime env (``trainer.launch.runtime_env.get_runtime_env``;
``RL_E2E_WARM_WORKERS=0`` for cold), then ``--actors`` actors created at once,
each importing what a trainer worker imports (``trainer.workers.actor``) and
loading the tiny model and tokenizer (which imports transformers' model code),
and ``ray.get`` on each one's ``ready``. Reported per mode, averaged over the
rounds (the order alternates: cold first in odd rounds):

* worker CPU: CPU seconds (user + system) of each actor's process up to ready,
  plus, warm, the warm process's own (its imports) shared over the actors;
* machine CPU: busy core-seconds of the whole machine (``/proc/stat``) from
  the first actor's creation to the last one's ready, over the actors;
* wall: seconds from creation to the last ready.

and the ratio warm / cold of each. Cluster start and shutdown are outside
what is measured.

    python bench/warm_workers.py [--actors 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil
import ray

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rl_e2e.warm_workers import SWITCH_VARIABLE  # noqa: E402
from trainer.launch.runtime_env import get_runtime_env  # noqa: E402
from trainer.models import ensure_tiny_model  # noqa: E402

MODES = ("cold", "warm")


@ray.remote(num_cpus=1)
class Imports:
    """An actor that imports what a trainer worker imports and loads the tiny model as it does."""

    def __init__(self, model_path: str) -> None:
        import trainer.workers.actor  # noqa: F401
        from trainer.models import load_causal_lm, load_tokenizer

        load_tokenizer(model_path)
        load_causal_lm(model_path)

    def ready(self) -> tuple[int, int]:
        return os.getpid(), os.getppid()


def _busy_core_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure(mode: str, actors: int, model_path: str) -> dict[str, float]:
    environ = {**os.environ, SWITCH_VARIABLE: "1" if mode == "warm" else "0"}
    ray.init(
        address="local",
        num_cpus=actors,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=get_runtime_env(environ),
    )
    try:
        busy, start = _busy_core_seconds(), time.perf_counter()
        handles = [Imports.remote(model_path) for _ in range(actors)]
        seen = ray.get([handle.ready.remote() for handle in handles])
        wall, busy = time.perf_counter() - start, _busy_core_seconds() - busy
        worker_cpu = sum(_cpu(pid) for pid, _ in seen)
        parents = {ppid for _, ppid in seen}
        if mode == "warm":
            assert len(parents) == 1, f"warm actors have {len(parents)} parents"
            worker_cpu += _cpu(parents.pop())  # its imports, once for all
        return {"worker": worker_cpu / actors, "machine": busy / actors, "wall": wall}
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_path = str(ensure_tiny_model())
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        for mode in order:
            figures = measure(mode, args.actors, model_path)
            results[mode].append(figures)
            print(
                f"round {round_ + 1} {mode}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            )
    mean = {
        mode: {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        for mode, rows in results.items()
    }
    print(
        f"\n{args.actors} actors importing trainer.workers.actor and loading the tiny model, "
        f"mean of {args.rounds} rounds"
    )
    print(f"{'':22}{'cold':>9}{'warm':>9}{'warm/cold':>11}")
    for key, label in (
        ("worker", "worker CPU s/actor"),
        ("machine", "machine core-s/actor"),
        ("wall", "wall s to ready"),
    ):
        cold, warm = mean["cold"][key], mean["warm"][key]
        print(f"{label:22}{cold:9.2f}{warm:9.2f}{warm / cold:10.2f}x")


if __name__ == "__main__":
    main()
