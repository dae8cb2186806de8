"""How close gpusched's packing comes to the best possible schedule, and what history buys.

Builds a synthetic suite in a temporary directory (40 files by default; each
needs 0, 1, 2, 4 or 8 GPUs and sleeps 1 to 8 s), then, in one run:

1. measures ``c``, the wall time of one ``python -m pytest`` subprocess on an
   empty test file (median of 5): the floor that isolation by subprocess costs;
2. ``gpusched plan`` and ``gpusched run --simulate-gpus 8`` without history
   (run 1), which writes ``.gpusched/durations.json``;
3. ``gpusched plan`` and ``gpusched run`` again (run 2), now packing by the
   durations run 1 measured;
4. ``gpusched run --fork-server off`` (run 3): run 2 with a fresh ``python -m
   pytest`` per file and warm starts (the behaviour before the fork server),
   so what the fork server buys is measured side by side;
5. runs the same files one after another (one pytest subprocess each) and sums
   their measured wall times: the sequential time.

The lower bound printed (every term is a schedule-independent bound):

    LB = max( sum_gpu(g_i * d_i) / 8,                     GPU-seconds over 8 cards
              max_i d_i,                                   the longest file
              max_k (1/k) * sum{d_i : g_i > 8/(k+1)},      k = 1..7: at most k such files fit at once
              sum_cpu(d_i) / cpu_slots )                   CPU files share the CPU slots

with ``d_i`` the file's sleep; ``LB'`` is the same bound with every ``d_i``
replaced by ``d_i + c``. The fork server (on by default) starts a file in
about a tenth of ``c`` (printed as "forked c", with the bound it gives), so
runs 1 and 2 can come below ``LB'``; run 3 uses fresh processes, where warm
starts overlap ``c`` of GPU files. Makespan is the span of the runner (first start to
last end, from ``--json``); the command's wall time including collection is
printed too. Targets: makespan/LB' <= 1.10 without history, <= 1.05 with it,
>= 3x faster than one after another, plan's prediction within 15% of the
measured makespan of run 2.

Packing on cores (``--cpu-slots`` as a budget each file's learnt CPU use
counts against, GPU files too) is shown on a virtual clock alone with
``--virtual``: no process runs; the policy replays the suite (every file
taking ``seconds + c``) with the CPU figures of each profile below, beside the
same suite packed without CPU figures (each CPU file one slot, GPU files only
cards: the rule before files were measured, and a first run's now):

- ``sleep, as measured``: every file counts ``SLEEP_CPU`` cores, what a
  sleeping test file's process tree measures (``gpusched plan``'s cpu column);
- ``1 core each``: every file, GPU files too, keeps one core busy;
- ``random 0.1-1.5``: figures drawn uniformly (``--seed``).

    python bench/sched_makespan.py            # 40 files, a few minutes
    python bench/sched_makespan.py --quick    # 16 shorter files, about a minute
    python bench/sched_makespan.py --virtual --files 44   # the virtual clock only, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpusched.history import load_history
from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.scheduling import Job, simulate

CARDS = 8
MIX = {0: 0.20, 1: 0.35, 2: 0.20, 4: 0.15, 8: 0.10}  # share of files needing that many GPUs
SLEEP_CPU = 0.05  # cores a file that sleeps 1-8 s measures (fork server, 2-core machine)


@dataclass(frozen=True)
class SyntheticFile:
    name: str
    gpus: int
    seconds: float


def make_suite(count: int, low: float, high: float, seed: int) -> list[SyntheticFile]:
    """``count`` files with GPU needs in the proportions of ``MIX`` and sleeps in [low, high]."""
    rng = random.Random(seed)
    needs = [gpus for gpus, share in MIX.items() for _ in range(round(share * count))]
    needs = (needs + [1] * count)[:count]
    rng.shuffle(needs)
    return [
        SyntheticFile(f"test_{i:02d}_gpu{gpus}.py", gpus, round(rng.uniform(low, high), 1))
        for i, gpus in enumerate(needs)
    ]


def write_suite(root: Path, files: list[SyntheticFile]) -> None:
    for file in files:
        marker = f"pytestmark = pytest.mark.gpu({file.gpus})\n" if file.gpus else ""
        (root / file.name).write_text(
            f"import time\n\nimport pytest\n\n{marker}\n\ndef test_work():\n"
            f"    time.sleep({file.seconds})\n",
            encoding="utf-8",
        )


def lower_bound(files: list[SyntheticFile], extra: float, cpu_slots: int) -> dict[str, float]:
    """The terms of the bound (see the module docstring), each file taking ``seconds + extra``."""
    gpu = [(f.gpus, f.seconds + extra) for f in files if f.gpus]
    cpu = [f.seconds + extra for f in files if not f.gpus]
    terms = {
        "gpu-seconds/8": sum(g * d for g, d in gpu) / CARDS,
        "longest file": max(f.seconds + extra for f in files),
        "cpu-seconds/slots": sum(cpu) / cpu_slots,
    }
    terms["wide files"] = max(
        sum(d for g, d in gpu if g > CARDS / (k + 1)) / k for k in range(1, CARDS)
    )
    return terms


def timed(command: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - start, done


def pytest_file(path: Path, cwd: Path) -> float:
    """Wall time of one ``python -m pytest FILE`` subprocess; its one test must pass.

    It sees all 8 simulated cards, as a gpusched child would see its own, so
    the plugin does not skip GPU tests on this machine without GPUs.
    """
    env = {
        **os.environ,
        "GPUSCHED_SIMULATED": "1",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(CARDS)),
    }
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0 or "1 passed" not in done.stdout:
        sys.exit(f"bench: {path.name} did not pass:\n{done.stdout}{done.stderr}")
    return seconds


def gpusched(cwd: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "gpusched", *args, ".", "--simulate-gpus", str(CARDS)]
    seconds, done = timed(command, cwd)
    if done.returncode != 0:
        sys.exit(f"bench: gpusched {' '.join(args)} exited {done.returncode}:\n{done.stdout}")
    return seconds, done


def predicted_makespan(output: str) -> float:
    found = re.search(r"predicted makespan ([\d.]+)s", output)
    if not found:
        sys.exit(f"bench: no prediction in gpusched plan's output:\n{output}")
    return float(found.group(1))


def measured_makespan(report: Path) -> float:
    files = json.loads(report.read_text(encoding="utf-8"))["files"]
    return max(f["end"] for f in files) - min(f["start"] for f in files)


def as_measured(files: list[SyntheticFile], report: Path) -> list[SyntheticFile]:
    """The files with the wall times one run measured for them (contention included)."""
    took = {
        Path(f["path"]).name: f["end"] - f["start"]
        for f in json.loads(report.read_text(encoding="utf-8"))["files"]
    }
    return [SyntheticFile(f.name, f.gpus, took[f.name]) for f in files]


def simulated_makespan(
    files: list[SyntheticFile],
    extra: float,
    cpu_slots: int,
    cpu: dict[str, float | None] | None = None,
) -> float:
    """gpusched's policy on a virtual clock, every file taking exactly ``seconds + extra`` and
    counting ``cpu[name]`` cores (None or missing: never measured)."""
    cpu = cpu or {}
    jobs = [
        Job(i, f.name, Requirement(f.gpus), f.seconds + extra, cpu.get(f.name))
        for i, f in enumerate(files)
    ]
    runs, _ = simulate([Card(str(i)) for i in range(CARDS)], jobs, cpu_slots)
    return max(run.end for run in runs)


def cpu_profiles(files: list[SyntheticFile], seed: int) -> dict[str, dict[str, float | None]]:
    """The CPU figures of the ``--virtual`` profiles (module docstring), by file name."""
    rng = random.Random(seed)
    return {
        "sleep, as measured": {f.name: SLEEP_CPU for f in files},
        "1 core each": {f.name: 1.0 for f in files},
        "random 0.1-1.5": {f.name: round(rng.uniform(0.1, 1.5), 2) for f in files},
    }


def virtual(files: list[SyntheticFile], extra: float, cpu_slots: int, seed: int) -> None:
    """Print the ``--virtual`` table: each profile's makespan beside the one without figures."""
    before = simulated_makespan(files, extra, cpu_slots)
    print(f"bench: virtual clock, every file taking its sleep + c = {extra:.2f} s")
    print(f"{'CPU figures':<22} {'makespan (s)':>13} {'without figures (s)':>20} {'ratio':>7}")
    print(f"{'never measured':<22} {before:>13.1f} {before:>20.1f} {1.0:>7.3f}")
    for name, cpu in cpu_profiles(files, seed).items():
        packed = simulated_makespan(files, extra, cpu_slots, cpu)
        print(f"{name:<22} {packed:>13.1f} {before:>20.1f} {packed / before:>7.3f}")


def learnt_cpu(root: Path) -> dict[str, float | None]:
    """Each file's CPU figure from the history the runs wrote (what run 2 packed on)."""
    history, _ = load_history(root / ".gpusched" / "durations.json")
    return {key: entry.cpu for key, entry in history.items()}


def forked_file(path: Path, times: int = 5) -> float:
    """Median seconds of ``pytest.main`` on ``path`` forked from a warm fork server."""
    from gpusched.execution.forkclient import ServerSpec, start_server

    spec = ServerSpec((), (), os.environ, Path(os.devnull), "bench", 120.0)
    server = start_server(spec).server
    assert server is not None, "the fork server did not start"
    took = []
    try:
        for _ in range(times):
            start = time.perf_counter()
            pid = server.spawn([str(path), "-q"], dict(os.environ), Path(os.devnull), "bench-c")
            server.wait(pid, None)
            took.append(time.perf_counter() - start)
    finally:
        server.close()
    return statistics.median(took)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 files of 1-3 s")
    parser.add_argument("--files", type=int, help="number of files (default 40, quick 16)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeline", type=Path, help="copy run 2's HTML timeline here")
    parser.add_argument(
        "--virtual", action="store_true", help="only the CPU profiles on the virtual clock"
    )
    parser.add_argument(
        "--c", type=float, default=0.6, help="with --virtual: per-file overhead c (s)"
    )
    parser.add_argument("--cpu-slots", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    count = args.files or (16 if args.quick else 40)
    if count < 5:
        parser.error(f"--files {count}: need at least 5 files")
    low, high = (1.0, 3.0) if args.quick else (1.0, 8.0)
    files = make_suite(count, low, high, args.seed)
    cpu_slots = args.cpu_slots
    if args.virtual:
        print(f"bench: {count} files ({', '.join(f'{sum(f.gpus == g for f in files)}x{g}' for g in MIX)} "
              f"GPUs), sleeps {low:g}-{high:g} s, {CARDS} cards, {cpu_slots} cores")  # fmt: skip
        virtual(files, args.c, cpu_slots, args.seed)
        return 0
    root = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
    try:
        write_suite(root, files)
        print(f"bench: {count} files ({', '.join(f'{sum(f.gpus == g for f in files)}x{g}' for g in MIX)} "
              f"GPUs), sleeps {low:g}-{high:g} s, {CARDS} simulated cards, {cpu_slots} CPU slots; "
              f"load average {load()}")  # fmt: skip

        empty = root / "empty" / "test_empty.py"
        empty.parent.mkdir()
        empty.write_text("def test_empty():\n    pass\n", encoding="utf-8")
        overhead = statistics.median(pytest_file(empty, empty.parent) for _ in range(5))
        forked = forked_file(empty)
        shutil.rmtree(empty.parent)

        plan1 = predicted_makespan(gpusched(root, "plan")[1].stdout)
        wall1, _ = gpusched(root, "run", "--json", "run1.json")
        run1 = measured_makespan(root / "run1.json")
        plan2 = predicted_makespan(gpusched(root, "plan")[1].stdout)
        wall2, _ = gpusched(root, "run", "--json", "run2.json", "--timeline", "run2.html")
        run2 = measured_makespan(root / "run2.json")
        wall3, _ = gpusched(root, "run", "--json", "run3.json", "--fork-server", "off")
        run3 = measured_makespan(root / "run3.json")
        if args.timeline:
            args.timeline.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / "run2.html", args.timeline)

        sequential = sum(pytest_file(root / f.name, root) for f in files)

        lb_terms = lower_bound(files, 0.0, cpu_slots)
        lbp_terms = lower_bound(files, overhead, cpu_slots)
        lb, lbp = max(lb_terms.values()), max(lbp_terms.values())
        # The same bound on the wall times each run measured: what packing alone left.
        lbm1 = max(lower_bound(as_measured(files, root / "run1.json"), 0.0, cpu_slots).values())
        lbm2 = max(lower_bound(as_measured(files, root / "run2.json"), 0.0, cpu_slots).values())
        lbm3 = max(lower_bound(as_measured(files, root / "run3.json"), 0.0, cpu_slots).values())
        ideal = simulated_makespan(files, overhead, cpu_slots, learnt_cpu(root))
        print(f"bench: c = {overhead:.2f} s (empty-file pytest subprocess, median of 5); "
              f"forked from a warm fork server: {forked:.3f} s")  # fmt: skip
        lbf = max(lower_bound(files, forked, cpu_slots).values())
        print("bench: LB' terms: " + ", ".join(f"{k} {v:.1f}" for k, v in lbp_terms.items()))
        rows = [
            ("makespan (s)", f"{run1:.1f}", f"{run2:.1f}", f"{run3:.1f}"),
            ("LB (s)", f"{lb:.1f}", f"{lb:.1f}", f"{lb:.1f}"),
            ("LB' (s)", f"{lbp:.1f}", f"{lbp:.1f}", f"{lbp:.1f}"),
            ("makespan / LB'", f"{run1 / lbp:.3f}", f"{run2 / lbp:.3f}", f"{run3 / lbp:.3f}"),
            (
                "makespan / LB with forked c",
                f"{run1 / lbf:.3f}",
                f"{run2 / lbf:.3f}",
                f"{run3 / lbf:.3f}",
            ),
            ("LB on measured file times (s)", f"{lbm1:.1f}", f"{lbm2:.1f}", f"{lbm3:.1f}"),
            (
                "makespan / that bound",
                f"{run1 / lbm1:.3f}",
                f"{run2 / lbm2:.3f}",
                f"{run3 / lbm3:.3f}",
            ),
            ("policy simulated on d+c (s)", "", f"{ideal:.1f}", ""),
            ("simulated / LB'", "", f"{ideal / lbp:.3f}", ""),
            ("sequential (s)", f"{sequential:.1f}", f"{sequential:.1f}", f"{sequential:.1f}"),
            (
                "speed-up vs sequential",
                f"{sequential / run1:.2f}x",
                f"{sequential / run2:.2f}x",
                f"{sequential / run3:.2f}x",
            ),
            ("plan's prediction (s)", f"{plan1:.1f}", f"{plan2:.1f}", ""),
            ("prediction / makespan", f"{plan1 / run1:.3f}", f"{plan2 / run2:.3f}", ""),
            ("wall with collection (s)", f"{wall1:.1f}", f"{wall2:.1f}", f"{wall3:.1f}"),
        ]
        width = max(len(row[0]) for row in rows)
        heads = ("run 1 (no history)", "run 2 (history)", "run 3 (--fork-server off)")
        print(f"{'':<{width}}  {heads[0]:>19}  {heads[1]:>16}  {heads[2]:>20}")
        for name, first, second, third in rows:
            print(f"{name:<{width}}  {first:>19}  {second:>16}  {third:>20}")
        print(f"bench: fork server: run 3 (fresh processes, warm starts) / run 2 makespan "
              f"{run3 / run2:.3f}")  # fmt: skip
        print(f"bench: load average at the end {load()}")
        checks = [
            (run1 / lbp <= 1.10, f"run 1 makespan/LB' {run1 / lbp:.3f} <= 1.10"),
            (run2 / lbp <= 1.05, f"run 2 makespan/LB' {run2 / lbp:.3f} <= 1.05"),
            (sequential / run2 >= 3.0, f"speed-up {sequential / run2:.2f}x >= 3x"),
            (abs(plan2 / run2 - 1) <= 0.15, f"prediction within 15% ({plan2 / run2 - 1:+.1%})"),
        ]
        for ok, text in checks:
            print(f"bench: {'met' if ok else 'MISSED'}: {text}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
