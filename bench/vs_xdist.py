"""gpusched against pytest-xdist on real suites: wall time and outcomes, side by side in one run.

Two suites, each run by two commands on the same install, ``--rounds`` rounds
(default 2), the order alternating (xdist first in odd rounds, gpusched first
in even ones), so a machine that speeds up or slows down over the run favours
neither:

1. ``this``: this repository's own suite (``tests``, from the checkout), the
   RL suite of Ray clusters, ranks and trainer runs;
2. ``pytest``: pytest's own suite (``testing``) from the sdist of the
   installed pytest, fetched with ``pip download`` (skipped with a message
   when pip cannot reach an index).

Commands: ``python -m pytest -n N --dist loadfile`` (pytest-xdist: one worker
process per core, each file whole on one worker) and ``gpusched run
--simulate-gpus G`` (G = N by default, so GPU-marked files run as on a node
with that many cards). gpusched keeps its ``.gpusched/`` state between runs,
as a user's repeat run does: it packs each file on the CPU use it measured
the time before; the line before each gpusched run says how many files its
history has CPU figures for. pytest-xdist is not a dependency of this
project: ``pip install pytest-xdist`` into the same environment first.

Prints each run (wall seconds, what it reported, the machine's busy core-seconds
over it and their share of cores x wall) and, per suite, the ratio
gpusched / xdist of each round and their mean.

    python bench/vs_xdist.py                                  # both suites, 2 rounds
    python bench/vs_xdist.py --suites this --this tests/gpusched/test_packing.py,tests/gpusched/test_history.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from real_suites import clean_env  # bench/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
XDIST = "xdist"
GPUSCHED = "gpusched"


@dataclass
class Suite:
    """A suite as both commands run it: from ``root``, on ``targets``."""

    name: str
    root: Path
    targets: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One command's run: wall seconds, exit code, tests by outcome, its last line, and the
    machine's busy core-seconds over it (all processes: the figure that says whether a slower
    run did more work or left cores idle)."""

    seconds: float
    code: int
    counts: dict[str, int]
    last: str
    busy: float

    def utilisation(self, cores: int) -> float:
        return self.busy / (cores * self.seconds)


def this_suite(paths: str) -> Suite:
    return Suite("this repository", ROOT, paths.split(","))


def pytest_suite(base: Path, paths: str, sdist: Path | None) -> Suite | str:
    """pytest's own tests from the sdist of the installed version (``sdist`` if given), or why not."""
    import pytest

    version = pytest.__version__
    if sdist is None:
        download = base / "pytest_sdist"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"pytest=={version}", "--no-binary",
             ":all:", "--no-deps", "-d", str(download), "-q"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        archives = list(download.glob("pytest-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            return f"pip download pytest=={version} failed (offline?): {proc.stderr.strip()[-300:]}"
    else:
        archives = [sdist]
    with tarfile.open(archives[0]) as archive:
        archive.extractall(base, filter="data")
    root = base / archives[0].name.removesuffix(".tar.gz")
    if not (root / "testing").is_dir():
        return f"{archives[0].name} has no testing/ directory"
    return Suite(f"pytest {version}", root, paths.split(","))


def commands(suite: Suite, workers: int, gpus: int) -> dict[str, list[str]]:
    return {
        XDIST: [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile",
                *suite.targets],
        GPUSCHED: [sys.executable, "-m", "gpusched", "run", *suite.targets, "--simulate-gpus",
                   str(gpus)],
    }  # fmt: skip


def outcome_counts(text: str) -> dict[str, int]:
    """The run's tests as gpusched's last line counts them: passed (xpassed too), failed
    (errors too), skipped (xfailed too), read from pytest's summary line or gpusched's."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    summary = next(
        (line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped)", line)), ""
    )
    bucket = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "failed",
              "errors": "failed", "skipped": "skipped", "xfailed": "skipped"}  # fmt: skip
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for number, kind in re.findall(r"(\d+) (\w+)", summary):
        if kind in bucket:
            counts[bucket[kind]] += int(number)
    return counts


def cpu_known(suite: Suite) -> str:
    """How many files gpusched's history in the suite's root has CPU figures for."""
    path = suite.root / ".gpusched" / "durations.json"
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return "no duration history yet"
    measured = sum(1 for entry in files.values() if "cpu" in entry)
    return f"history: {len(files)} files, {measured} with CPU figures"


def busy_seconds() -> float:
    """Core-seconds this machine has spent on anything but idling and waiting for I/O since boot."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def run_once(command: list[str], suite: Suite, timeout: float) -> Run:
    busy = busy_seconds()
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=suite.root, env=clean_env(suite.env), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    busy = busy_seconds() - busy
    text = proc.stdout + proc.stderr
    lines = text.strip().splitlines()
    return Run(seconds, proc.returncode, outcome_counts(text), lines[-1] if lines else "", busy)


def describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{number} {kind}" for kind, number in counts.items())


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--first-round",
        type=int,
        default=1,
        help="number of the first round (2: gpusched first, to continue an earlier run)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="xdist's -n")
    parser.add_argument("--gpus", type=int, help="gpusched's --simulate-gpus (default: -n)")
    parser.add_argument("--suites", default="this,pytest", help="comma-separated: this, pytest")
    parser.add_argument("--this", default="tests", help="paths of this suite to run (comma-sep.)")
    parser.add_argument("--pytest", default="testing", help="paths of pytest's suite to run")
    parser.add_argument(
        "--pytest-sdist", type=Path, help="pytest's sdist (.tar.gz) instead of pip download"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("xdist") is None:
        parser.error("pytest-xdist is not installed here: pip install pytest-xdist")
    gpus = args.gpus if args.gpus is not None else args.workers
    cores = psutil.cpu_count() or 1
    wanted = args.suites.split(",")
    print(f"bench: {os.cpu_count()} cores, xdist -n {args.workers} --dist loadfile, gpusched "
          f"--simulate-gpus {gpus}, {args.rounds} rounds; load average {load()}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gs-xdist-") as tmp:
        suites: list[Suite] = []
        if "this" in wanted:
            suites.append(this_suite(args.this))
        if "pytest" in wanted:
            suite_or_why = pytest_suite(Path(tmp), args.pytest, args.pytest_sdist)
            if isinstance(suite_or_why, str):
                print(f"bench: pytest's suite SKIPPED: {suite_or_why}")
            else:
                suites.append(suite_or_why)
        ratios: dict[str, list[float]] = {suite.name: [] for suite in suites}
        numbers = range(args.first_round, args.first_round + args.rounds)
        for round_number in numbers:
            order = [XDIST, GPUSCHED] if round_number % 2 else [GPUSCHED, XDIST]
            for suite in suites:
                runs: dict[str, Run] = {}
                for tool in order:
                    if tool == GPUSCHED:
                        print(f"bench: {suite.name}: gpusched's {cpu_known(suite)}")
                    command = commands(suite, args.workers, gpus)[tool]
                    runs[tool] = run = run_once(command, suite, args.timeout)
                    print(f"round {round_number}  {suite.name:<18} {tool:<9} {run.seconds:8.1f} s"
                          f"  exit {run.code}: {describe(run.counts)}; busy {run.busy:.0f} core-s"
                          f" ({run.utilisation(cores):.0%} of the cores)")  # fmt: skip
                ratio = runs[GPUSCHED].seconds / runs[XDIST].seconds
                ratios[suite.name].append(ratio)
                same = "same outcomes" if runs[GPUSCHED].counts == runs[XDIST].counts else (
                    "OUTCOMES DIFFER")  # fmt: skip
                print(f"round {round_number}  {suite.name:<18} gpusched / xdist {ratio:.3f}x"
                      f" ({' first, '.join(order)} second; {same})")  # fmt: skip
    print(f"\nbench: load average at the end {load()}")
    print(f"{'suite':<20} " + " ".join(f"{f'round {r}':>9}" for r in numbers)
          + f" {'mean':>7}")  # fmt: skip
    for name, values in ratios.items():
        cells = " ".join(f"{value:>8.3f}x" for value in values)
        print(f"{name:<20} {cells} {sum(values) / len(values):>6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
