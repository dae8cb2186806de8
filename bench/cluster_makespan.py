"""One suite on a simulated 3-node cluster, three ways: ``--ray``, static shards, the lower bound.

Builds a synthetic suite in a temporary directory (24 files by default; each
needs 0, 1, 2 or 4 cards and sleeps 1 to 8 s) and a real Ray cluster on this
machine (``ray.cluster_utils``: 3 raylets, each declaring 4 simulated cards
with ``GPUSCHED_SIMULATE_GPUS`` and two CPUs), then, in one run:

1. ``gpusched run --ray`` across the cluster (run 1, no history and no
   collection cache: it writes ``.gpusched/durations.json`` and
   ``.gpusched/collection.json``; files stream from the collection to the
   nodes while the agents start);
2. static sharding as CI does it, with that history: ``gpusched shard
   --runner-sizes 4 --gpus-per-runner 4 --shards 3 --index I --run
   --simulate-gpus 4 --cpu-slots 2``, the three shards started side by side,
   one per node;
3. ``gpusched run --ray`` again (run 2, packing by the history run 1 measured,
   its requirements from the collection cache).

Makespan is first start to last end of the files (``--json``); a shard run's
is its slowest shard's, from their common start. The rigid-task lower bound
for nodes of ``C_n`` cards and ``s_n`` CPU slots, with ``d_i`` each file's
sleep and ``g_i`` its cards:

    LB = max( sum(g_i d_i) / sum(C_n),                          GPU-seconds over every card
              max_i d_i,                                         the longest file
              max_m sum{d_i : g_i >= m} / sum_n floor(C_n / m),  m = 2..4: so many fit at once
              sum_cpu(d_i) / sum(s_n) )                          CPU files share the CPU slots

``LB'`` adds ``c`` to every ``d_i``: the wall time of one ``python -m pytest``
on an empty file, the start-up a file pays (less with the fork server).
"Same order, virtual clock" replays the cluster policy with each run's
expected durations (none without history: every file expects the same) while
each file takes exactly ``d_i``, no start-up: the makespan (and its ratio to
LB') that the run's order alone gives. "Outside the makespan" is the command's
wall time less its makespan: collection, connecting, the agents' start, the
end of the run and the summary. ``c`` is a cold start measured beside the
runs, so a loaded machine raises LB' while the fork server's files do not pay
it: under load read makespan / LB (no start-up) beside it.
Targets: ``--ray`` makespan at most 1.15 x LB' without history and 1.10 x LB'
with it, and at least 1.2 x shorter than static shards. Without history the
scheduler cannot tell this suite's files apart, so its makespan is that of one
file order, a draw: ``bench/cluster_first_run.py`` measures the first run over
many orders.

    python bench/cluster_makespan.py            # 24 files, about three minutes on 2 cores
    python bench/cluster_makespan.py --quick    # 12 shorter files
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from unittest import mock

import psutil
from sched_makespan import SyntheticFile, write_suite  # bench/ is the script's sys.path[0]

from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.scheduling.cluster import ClusterPolicy, Node
from gpusched.scheduling.packing import Job

NODES = 3
CARDS = 4
SLOTS = 2  # CPU slots per node (Ray CPUs of each raylet; a sleeping file uses no core)
MIX = {0: 0.25, 1: 0.35, 2: 0.25, 4: 0.15}  # share of files needing that many cards
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def make_suite(count: int, low: float, high: float, seed: int) -> list[SyntheticFile]:
    rng = random.Random(seed)
    sizes = rng.choices(list(MIX), weights=list(MIX.values()), k=count)
    return [
        SyntheticFile(f"test_s{i:02d}.py", gpus, round(rng.uniform(low, high), 1))
        for i, gpus in enumerate(sizes)
    ]


def relabelled(files: list[SyntheticFile], rng: random.Random) -> list[SyntheticFile]:
    """The same widths and sleeps under the same names in another order (the policy breaks
    ties by file order, so this draws another first run of the same suite)."""
    shuffled = rng.sample(files, len(files))
    return [SyntheticFile(f"test_s{i:02d}.py", f.gpus, f.seconds) for i, f in enumerate(shuffled)]


def lower_bound(files: list[SyntheticFile], extra: float) -> float:
    cards = [CARDS] * NODES
    slots = NODES * SLOTS
    d = {f.name: f.seconds + extra for f in files}
    terms = [
        sum(f.gpus * d[f.name] for f in files) / sum(cards),
        max(d.values()),
        sum(d[f.name] for f in files if not f.gpus) / slots,
    ]
    for m in range(2, CARDS + 1):
        fit = sum(c // m for c in cards)
        terms.append(sum(d[f.name] for f in files if f.gpus >= m) / fit)
    return max(terms)


def virtual_makespan(files: list[SyntheticFile], extra: float, history: bool) -> float:
    """The cluster policy on a virtual clock: each file takes ``seconds + extra``; it expects
    that (``history``) or, as a first run does, the same as every other file."""
    nodes = [
        Node(f"n{n}", f"n{n}", tuple(Card(str(i)) for i in range(CARDS)), SLOTS)
        for n in range(NODES)
    ]
    policy = ClusterPolicy(nodes)
    policy.submit(
        Job(i, f.name, Requirement(f.gpus), f.seconds if history else 1.0)
        for i, f in enumerate(files)
    )
    now, ends = 0.0, []
    while True:
        for decision in policy.schedule():
            heapq.heappush(ends, (now + files[decision.job.id].seconds + extra, decision.job.id))
        if not ends:
            return now
        now, job_id = heapq.heappop(ends)
        policy.complete(job_id)


@contextmanager
def simulated_cluster() -> Iterator[str]:
    """A real Ray cluster of ``NODES`` raylets on this machine, each declaring ``CARDS``
    simulated cards and ``SLOTS`` CPUs; yields its address, removes every node after, and its
    temp dir (``RAY_TMPDIR``: its sessions and the address file ``cluster_utils`` writes,
    which would otherwise leave ``ray.init()`` on this machine pointing at a dead cluster)."""
    os.environ.update(ENV)
    from ray.cluster_utils import Cluster

    declare = {"GPUSCHED_SIMULATE_GPUS": str(CARDS)}
    with (
        # In /tmp: Ray's socket paths must stay short.
        tempfile.TemporaryDirectory(prefix="gsb", dir="/tmp", ignore_cleanup_errors=True) as tmp,
        mock.patch.dict(os.environ, {"RAY_TMPDIR": tmp}),
    ):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": SLOTS, "include_dashboard": False, "env_vars": declare},
        )
        try:
            for _ in range(NODES - 1):
                cluster.add_node(num_cpus=SLOTS, env_vars=declare)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            # A killed raylet's agents (dashboard, runtime env) can outlive it: kill them too.
            family = []
            for node in [*cluster.worker_nodes, cluster.head_node]:
                for info in node.all_processes.values() if node else ():
                    for started in info:
                        with suppress(psutil.NoSuchProcess):
                            raylet = psutil.Process(started.process.pid)
                            family += [raylet, *raylet.children(recursive=True)]
            for node in list(cluster.worker_nodes):
                cluster.remove_node(node, allow_graceful=False)
            if cluster.head_node is not None:
                cluster.remove_node(cluster.head_node, allow_graceful=False)
            for process in family:
                with suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(family, timeout=10)


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "CUDA_VIS"))}
    clean.pop("RAY_ADDRESS", None)
    return {**clean, **ENV}


def gpusched(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpusched", *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, what: str) -> str:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bench: {what} failed ({proc.returncode}):\n{out}")
    return out


def span(report: Path) -> tuple[float, float]:
    files = [f for f in json.loads(report.read_text())["files"] if f["end"] > f["start"]]
    return min(f["start"] for f in files), max(f["end"] for f in files)


def pytest_start(root: Path, times: int = 7) -> float:
    """``c``: the median wall time of ``times`` runs of pytest on an empty file, after one
    run left out (the first one reads its files from disk and is slower)."""
    empty = root / "empty" / "test_empty.py"
    empty.parent.mkdir()
    empty.write_text("def test_empty():\n    pass\n")
    walls = []
    for _ in range(times + 1):
        t = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(empty)],
            env=env(),
            capture_output=True,
            check=True,
        )
        walls.append(time.monotonic() - t)
    return statistics.median(walls[1:])


def ray_run(root: Path, address: str, report: str) -> tuple[float, float]:
    t = time.monotonic()
    finish(gpusched(root, "run", ".", "--ray", address, "--json", report), "--ray run")
    wall = time.monotonic() - t
    start, end = span(root / report)
    return end - start, wall


def shard_runs(root: Path) -> tuple[float, float]:
    t = time.monotonic()
    procs = [
        gpusched(
            root,
            "shard",
            ".",
            "--runner-sizes",
            str(CARDS),
            "--gpus-per-runner",
            str(CARDS),
            "--shards",
            str(NODES),
            "--index",
            str(i),
            "--run",
            "--simulate-gpus",
            str(CARDS),
            "--cpu-slots",
            "1",
            "--json",
            f"shard{i}.json",
        )  # fmt: skip
        for i in range(NODES)
    ]
    for i, proc in enumerate(procs):
        finish(proc, f"shard {i}")
    wall = time.monotonic() - t
    # Each shard's runner counts from its own start; they started together.
    makespan = max(span(root / f"shard{i}.json")[1] for i in range(NODES))
    return makespan, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="12 files of 1 to 4 s")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    count, high = (12, 4.0) if args.quick else (args.files, 8.0)
    files = make_suite(count, 1.0, high, args.seed)
    with tempfile.TemporaryDirectory(prefix="gs-cluster-bench-") as tmp:
        root = Path(tmp)
        c = pytest_start(root)
        suite = root / "suite"
        suite.mkdir()
        write_suite(suite, files)
        with simulated_cluster() as address:
            run1, wall1 = ray_run(suite, address, "ray1.json")
            shards, shard_wall = shard_runs(suite)
            run2, wall2 = ray_run(suite, address, "ray2.json")
    lb, lbp = lower_bound(files, 0.0), lower_bound(files, c)
    mix = {g: sum(1 for f in files if f.gpus == g) for g in MIX}
    print(
        f"bench: {len(files)} files ({', '.join(f'{n} x {g} cards' for g, n in mix.items())}), "
        f"{sum(f.seconds for f in files):.0f} s of sleep; {NODES} nodes x {CARDS} simulated "
        f"cards, {SLOTS} CPU slots each; c = {c:.2f} s (one pytest subprocess)"
    )
    order1, order2 = virtual_makespan(files, 0.0, False), virtual_makespan(files, 0.0, True)
    rows = [
        ("", "--ray run 1 (no history)", "static shards (history)", "--ray run 2 (history)"),
        ("makespan (s)", f"{run1:.1f}", f"{shards:.1f}", f"{run2:.1f}"),
        ("command wall time (s)", f"{wall1:.1f}", f"{shard_wall:.1f}", f"{wall2:.1f}"),
        ("outside the makespan (s)", f"{wall1 - run1:.1f}", "-", f"{wall2 - run2:.1f}"),
        ("makespan / LB'", f"{run1 / lbp:.3f}", f"{shards / lbp:.3f}", f"{run2 / lbp:.3f}"),
        ("makespan / LB", f"{run1 / lb:.3f}", f"{shards / lb:.3f}", f"{run2 / lb:.3f}"),
        (
            "same order, virtual clock (s, / LB')",
            f"{order1:.1f} ({order1 / lbp:.3f})",
            "-",
            f"{order2:.1f} ({order2 / lbp:.3f})",
        ),
        ("static shards / this", f"{shards / run1:.2f}x", "1.00x", f"{shards / run2:.2f}x"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"LB {lb:.1f} s, LB' {lbp:.1f} s")
    checks = [
        ("no history (one file order): makespan/LB'", run1 / lbp, "<=", 1.15),
        ("history: makespan/LB'", run2 / lbp, "<=", 1.10),
        ("history: static/--ray", shards / run2, ">=", 1.2),
    ]
    print(
        "targets: "
        + "; ".join(
            f"{name} {value:.3f} {op} {bound}: "
            + ("yes" if (value <= bound if op == "<=" else value >= bound) else "no")
            for name, value, op, bound in checks
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
