"""``gpusched run --ray``'s first run (no history) over many file orders: the draw taken out.

Without history every file expects the same time, so the scheduler cannot tell
a long file from a short one that needs as many cards: it breaks the tie by
file order. One suite's first-run makespan therefore depends on where its
longest files happen to fall in that order, a random draw. On the virtual
clock (``bench/cluster_virtual.py``) the bench suite of
``bench/cluster_makespan.py`` (seed 7) gives 1.15 x LB' as drawn but 1.05 on
average over 500 orders of its files.

This script measures the real run without that draw. On one real Ray cluster
(``cluster_makespan.simulated_cluster``: 3 raylets x 4 simulated cards, 2 CPU
slots each) it runs the bench suite ``--orders`` times, each time with its
files relabelled in another random order (the same widths and sleeps under
other names), as a first run: a fresh directory, no history, no collection
cache. Per order it prints the makespan / LB' and the same order replayed on
the virtual clock / LB' (``cluster_makespan.virtual_makespan``), paired: their
difference is what the run itself adds to its order (start-ups, hand-offs),
the part that does not depend on the draw. The summary gives the mean of each
with its spread, the same makespans against LB' with ``c`` fixed at 0.4, 0.5
and 0.6 s (``c`` is measured beside the run and moves with the machine's load,
the sleeping files' makespans hardly), how many orders meet the target and a
one-sided sign test of "a first run's makespan / LB' is at most 1.15".

``--suites`` draws new suites instead (``cluster_makespan.make_suite`` with
seeds 0 to N-1): the suite's widths and sleeps are then drawn too.

    python bench/cluster_first_run.py               # 12 orders, about 3.5 minutes on 2 cores
    python bench/cluster_first_run.py --suites      # 12 suites
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

from cluster_makespan import (  # bench/ is the script's sys.path[0]
    lower_bound,
    make_suite,
    pytest_start,
    ray_run,
    relabelled,
    simulated_cluster,
    virtual_makespan,
)
from sched_makespan import write_suite

BENCH_SEED = 7  # cluster_makespan.py's default suite
TARGET = 1.15  # a first run: makespan at most 1.15 x LB' (as cluster_makespan.py)
FIXED_C = (0.4, 0.5, 0.6)  # c moves with the machine's load; the makespans do not


def sign_test(met: int, runs: int) -> float:
    """One-sided sign test: the chance of ``met`` or more of ``runs`` if each were a coin toss."""
    return sum(math.comb(runs, k) for k in range(met, runs + 1)) / 2**runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=12, help="first runs (default 12)")
    parser.add_argument(
        "--suites", action="store_true", help="draw a new suite per run (seeds 0..N-1)"
    )
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error(f"--orders {args.orders}: needs at least 1")
    rng = random.Random(0)
    bench = make_suite(24, 1.0, 8.0, BENCH_SEED)
    draws = [
        make_suite(24, 1.0, 8.0, seed) if args.suites else relabelled(bench, rng)
        for seed in range(args.orders)
    ]
    what = "suites drawn with seeds" if args.suites else f"orders of the seed-{BENCH_SEED} suite,"
    real, virtual, to_lb, spans = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="gs-first-run-") as tmp:
        root = Path(tmp)
        c = pytest_start(root)
        print(
            f"bench: {args.orders} first runs of `gpusched run --ray` ({what} 0-{args.orders - 1}); "
            f"3 nodes x 4 simulated cards, 2 CPU slots each; c = {c:.2f} s (one pytest subprocess)"
        )
        print("draw  makespan (s)  / LB'   virtual clock (s)  / LB'   run - virtual (/ LB')")
        with simulated_cluster() as address:
            for i, files in enumerate(draws):
                suite = root / f"suite{i:02d}"
                suite.mkdir()
                write_suite(suite, files)
                makespan, _ = ray_run(suite, address, "ray.json")
                replay = virtual_makespan(files, 0.0, history=False)
                lbp = lower_bound(files, c)
                spans.append(makespan)
                real.append(makespan / lbp)
                virtual.append(replay / lbp)
                to_lb.append(makespan / lower_bound(files, 0.0))
                print(
                    f"{i:>4}  {makespan:>12.1f}  {real[-1]:.3f}  {replay:>17.1f}  {virtual[-1]:.3f}"
                    f"   {real[-1] - virtual[-1]:+.3f}",
                    flush=True,
                )
    met = sum(r <= TARGET for r in real)
    sign_p = sign_test(met, len(real))
    for label, values in (
        ("makespan / LB'", real),
        ("makespan / LB (no start-up)", to_lb),
        ("its order on the virtual clock / LB'", virtual),
        (
            "run - virtual clock (/ LB'), paired",
            [r - v for r, v in zip(real, virtual, strict=True)],
        ),
    ):
        print(
            f"{label}: mean {statistics.mean(values):.3f}, sd {statistics.pstdev(values):.3f}, "
            f"range {min(values):.3f}-{max(values):.3f}"
        )
    at_c = {
        fixed: statistics.mean(m / lower_bound(f, fixed) for m, f in zip(spans, draws, strict=True))
        for fixed in FIXED_C
    }
    print(
        "the same makespans against LB' with c fixed: "
        + ", ".join(f"c {fixed:.1f} s: mean {mean:.3f}" for fixed, mean in at_c.items())
    )
    print(
        f"target: makespan / LB' <= {TARGET} in {met} of {len(real)} first runs "
        f"(sign test, one-sided: p = {sign_p:.4f}); mean {statistics.mean(real):.3f} <= {TARGET}: "
        + ("yes" if statistics.mean(real) <= TARGET else "no")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
