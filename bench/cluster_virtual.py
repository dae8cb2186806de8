"""The cluster policy's order on a virtual clock, over many random suites: no Ray, no process.

``bench/cluster_makespan.py`` measures one suite (seed 7) on a real Ray
cluster; whether its order is good or lucky needs many suites. This script
draws ``--seeds`` suites per family, replays ``ClusterPolicy`` on a virtual
clock where each file takes exactly its sleep (``cluster_makespan.virtual_makespan``,
the same replay as the bench's "same order, virtual clock" row), and prints the
mean, 90th percentile and worst makespan / LB' (LB' with ``--c`` seconds of
start-up per file, as the bench's cold start) and the mean makespan / LB:

- without history: every file expects the same time, as on a first run;
- with history: every file expects its own sleep.

Families (3 nodes x 4 cards, 2 CPU slots each, as the bench):

- ``cluster 24``: ``cluster_makespan.make_suite`` (24 files, 0/1/2/4 cards, 1-8 s);
- ``cluster 12 quick``: the same draw, 12 files of 1-4 s (the bench's ``--quick``);
- ``cluster 48``: the same draw, 48 files;
- ``single-node 40``: ``sched_makespan.make_suite`` (40 files, 0/1/2/4/8 GPUs),
  its 8-GPU files needing 4 cards (the most a node has).

Last, the bench's own suite (``cluster 24``, seed 7) with its files relabelled
in ``--seeds`` random orders: where the policy breaks ties by file order, this
is the spread that the order of the files alone gives.

    python bench/cluster_virtual.py               # 500 seeds per family, a few seconds
    python bench/cluster_virtual.py --seeds 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable

import sched_makespan  # bench/ is the script's sys.path[0]
from cluster_makespan import CARDS, lower_bound, make_suite, relabelled, virtual_makespan
from sched_makespan import SyntheticFile

BENCH_SEED = 7  # cluster_makespan.py's default

Draw = Callable[[int], list[SyntheticFile]]


def single_node_suite(seed: int) -> list[SyntheticFile]:
    """The single-node bench's 40 files; an 8-GPU file needs the 4 cards of one node here."""
    files = sched_makespan.make_suite(40, 1.0, 8.0, seed)
    return [SyntheticFile(f.name, min(f.gpus, CARDS), f.seconds) for f in files]


FAMILIES: dict[str, Draw] = {
    "cluster 24": lambda seed: make_suite(24, 1.0, 8.0, seed),
    "cluster 12 quick": lambda seed: make_suite(12, 1.0, 4.0, seed),
    "cluster 48": lambda seed: make_suite(48, 1.0, 8.0, seed),
    "single-node 40": single_node_suite,
}


def ratios(
    suites: list[list[SyntheticFile]], history: bool, c: float
) -> tuple[list[float], list[float]]:
    """Makespan / LB' and makespan / LB of the policy's order for each suite."""
    to_lbp, to_lb = [], []
    for files in suites:
        makespan = virtual_makespan(files, 0.0, history)
        to_lbp.append(makespan / lower_bound(files, c))
        to_lb.append(makespan / lower_bound(files, 0.0))
    return to_lbp, to_lb


def summary(to_lbp: list[float], to_lb: list[float]) -> str:
    ranked = sorted(to_lbp)
    p90 = ranked[int(0.9 * (len(ranked) - 1))]
    return (
        f"mean {statistics.mean(to_lbp):.3f}  p90 {p90:.3f}  worst {ranked[-1]:.3f}  "
        f"| / LB mean {statistics.mean(to_lb):.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=500, help="suites per family")
    parser.add_argument("--c", type=float, default=0.6, help="start-up per file in LB' (s)")
    args = parser.parse_args(argv)
    print(
        f"bench: ClusterPolicy on a virtual clock (each file takes exactly its sleep), "
        f"seeds 0-{args.seeds - 1} per family; makespan / LB' with c = {args.c:g} s"
    )
    width = max(len(name) for name in FAMILIES) + len("  with history")
    for name, draw in FAMILIES.items():
        suites = [draw(seed) for seed in range(args.seeds)]
        for history in (False, True):
            label = f"{name}  {'with history' if history else 'no history'}"
            print(f"{label:<{width}}  {summary(*ratios(suites, history, args.c))}")
    bench = FAMILIES["cluster 24"](BENCH_SEED)
    rng = random.Random(0)
    orders = [relabelled(bench, rng) for _ in range(args.seeds)]
    for history in (False, True):
        print(
            f"bench suite (seed {BENCH_SEED}) {'with history' if history else 'no history'}: "
            f"as drawn {ratios([bench], history, args.c)[0][0]:.3f}; in {args.seeds} random "
            f"file orders {summary(*ratios(orders, history, args.c))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
