"""gpusched against plain pytest on real suites: start-up cost, side by side in one run.

Three suites, each run by three commands, round-robin, ``--repeat`` times:

1. ``torch-conftest``: 30 small CPU files whose ``conftest.py`` does ``import torch``
   (3 trivial tests each), built in a temporary directory. Plain pytest pays the
   import once; a fresh process per file pays it 30 times.
2. ``click``: click's own test suite from its sdist, fetched with
   ``pip download click==VERSION --no-binary :all:`` (skipped with a message
   when pip cannot reach an index), run with its ``src`` on ``PYTHONPATH``.
3. ``empty-files``: 60 files of one empty test, no conftest, with
   ``--cpu-slots 1``: the marginal cost per file of ``gpusched run``
   (T(60) - T(1)) / 59 next to that of forking ``pytest.main`` directly from
   a warm fork server (no runner): the difference is the runner's own
   overhead per CPU file (spawn request, streaming, kill sweep, release, report).

Commands: ``python -m pytest -q``; ``gpusched run`` as a first run (the
fork server, default; ``.gpusched/`` removed before each, as on a fresh
checkout or a CI job without a cache: no duration history, no collection
cache); ``gpusched run`` as a repeat run (``.gpusched/`` kept from the run
before, as a user's second run or a CI job that caches it); ``gpusched run
--fork-server off`` (a fresh ``python -m pytest`` per file, repeat run).
Each figure is the minimum over the repetitions (all are printed).
Targets: click: gpusched <= 1.0x plain pytest, first and repeat runs;
torch-conftest: gpusched <= 1.5x plain pytest and >= 5x faster than
``--fork-server off``.

    python bench/real_suites.py                 # all suites, 2 repetitions
    python bench/real_suites.py --suites torch-conftest --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TRIVIAL = "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n\n\ndef test_c():\n    pass\n"


@dataclass
class Suite:
    name: str
    root: Path
    target: str  # the path given to pytest / gpusched
    env: dict[str, str] = field(default_factory=dict)
    gpusched_args: tuple[str, ...] = ()


@dataclass
class Timing:
    seconds: list[float] = field(default_factory=list)
    last_line: str = ""
    code: int = 0

    @property
    def best(self) -> float:
        return min(self.seconds)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSCHED_", "PYTEST_")) and k != "CUDA_VISIBLE_DEVICES"
    }
    env.update(extra)
    return env


def torch_suite(base: Path, files: int = 30) -> Suite:
    root = base / "torch_conftest"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "conftest.py").write_text("import torch\n")
    for i in range(files):
        (root / "tests" / f"test_f{i:02d}.py").write_text(TRIVIAL)
    return Suite("torch-conftest", root, "tests")


def empty_suite(base: Path, files: int) -> Suite:
    root = base / f"empty_{files}"
    (root / "tests").mkdir(parents=True)
    for i in range(files):
        (root / "tests" / f"test_e{i:03d}.py").write_text("def test_empty():\n    pass\n")
    return Suite(f"empty-{files}", root, "tests", gpusched_args=("--cpu-slots", "1"))


def click_suite(base: Path, version: str) -> Suite | str:
    """click's sdist tests, or why not (offline, no sdist)."""
    download = base / "click_sdist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", f"click=={version}", "--no-binary", ":all:",
         "--no-deps", "-d", str(download), "-q"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    archives = list(download.glob("click-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        return f"pip download click=={version} failed (offline?): {proc.stderr.strip()[-300:]}"
    with tarfile.open(archives[0]) as archive:
        archive.extractall(base, filter="data")
    root = base / archives[0].name.removesuffix(".tar.gz")
    if not (root / "tests").is_dir():
        return f"{archives[0].name} has no tests/ directory"
    return Suite(f"click {version}", root, "tests", env={"PYTHONPATH": str(root / "src")})


FIRST = "gpusched (first run)"
REPEAT = "gpusched (repeat run)"
OFF = "gpusched --fork-server off"


def commands(suite: Suite) -> dict[str, list[str]]:
    """The commands, in the order each repetition runs them (the first run clears state)."""
    gpusched = [sys.executable, "-m", "gpusched", "run", suite.target, *suite.gpusched_args]
    return {
        "pytest": [sys.executable, "-m", "pytest", "-q", suite.target],
        FIRST: gpusched,
        REPEAT: gpusched,
        OFF: [*gpusched, "--fork-server", "off"],
    }


def run_once(command: list[str], suite: Suite) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=suite.root, env=clean_env(suite.env), capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return seconds, proc.returncode, lines[-1] if lines else ""


def measure(suite: Suite, repeat: int) -> dict[str, Timing]:
    timings = {name: Timing() for name in commands(suite)}
    for _ in range(repeat):
        for name, command in commands(suite).items():
            if name == FIRST:
                shutil.rmtree(suite.root / ".gpusched", ignore_errors=True)
            seconds, code, last = run_once(command, suite)
            timing = timings[name]
            timing.seconds.append(seconds)
            timing.code, timing.last_line = code, last
    return timings


def direct_fork_marginal(suite_many: Suite, suite_one: Suite) -> float:
    """Seconds per file of ``pytest.main`` forked from a warm fork server, no runner around it."""
    code = f"""
import os, sys, time
from pathlib import Path
from gpusched.execution.forkclient import ServerSpec, start_server
spec = ServerSpec((), (), os.environ, Path(os.devnull), "bench", 120.0)
server = start_server(spec).server
def run(root):
    files = sorted(Path(root, "tests").glob("test_*.py"))
    start = time.perf_counter()
    for path in files:
        stream = str(path) + ".jsonl"  # as a gpusched child: results streamed, cache on
        pid = server.spawn([str(path), "--gpusched-results=" + stream], dict(os.environ),
                           Path(os.devnull), "bench-job")
        server.wait(pid, None)
    return time.perf_counter() - start, len(files)
many, n = run({str(suite_many.root)!r})
one, _ = run({str(suite_one.root)!r})
server.close()
print((many - one) / (n - 1))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env({}), timeout=600
    )
    return float(proc.stdout.strip().splitlines()[-1])


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_suite(suite: Suite, timings: dict[str, Timing]) -> None:
    plain, first, fork, fresh = (timings[k] for k in commands(suite))
    print(f"\n{suite.name}")
    for name, timing in timings.items():
        runs = ", ".join(f"{s:.2f}" for s in timing.seconds)
        print(f"  {name:<28} {timing.best:7.2f} s   (runs: {runs}; exit {timing.code}: "
              f"{timing.last_line[:70]})")  # fmt: skip
    print(f"  first run / plain pytest       {first.best / plain.best:6.2f}x")
    print(f"  repeat run / plain pytest      {fork.best / plain.best:6.2f}x")
    print(f"  --fork-server off / plain      {fresh.best / plain.best:6.2f}x")
    print(f"  --fork-server off / repeat     {fresh.best / fork.best:6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--click-version", default="8.5.1")
    parser.add_argument(
        "--suites", default="torch-conftest,click,empty-files",
        help="comma-separated: torch-conftest, click, empty-files",
    )  # fmt: skip
    args = parser.parse_args()
    wanted = set(args.suites.split(","))
    print(f"cores: {os.cpu_count()}   load before: {load()}   repeat: {args.repeat}")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gs-real-") as tmp:
        base = Path(tmp)
        if "torch-conftest" in wanted:
            suite = torch_suite(base)
            timings = measure(suite, args.repeat)
            print_suite(suite, timings)
            results["torch"] = timings[REPEAT].best / timings["pytest"].best
            results["torch first"] = timings[FIRST].best / timings["pytest"].best
            results["torch_off"] = timings[OFF].best / timings[REPEAT].best
        if "click" in wanted:
            suite_or_why = click_suite(base, args.click_version)
            if isinstance(suite_or_why, str):
                print(f"\nclick: SKIPPED: {suite_or_why}")
            else:
                timings = measure(suite_or_why, args.repeat)
                print_suite(suite_or_why, timings)
                results["click"] = timings[REPEAT].best / timings["pytest"].best
                results["click first"] = timings[FIRST].best / timings["pytest"].best
        if "empty-files" in wanted:
            many, one = empty_suite(base, 60), empty_suite(base, 1)
            gs = [sys.executable, "-m", "gpusched", "run", "tests", "--cpu-slots", "1"]
            per_run = {}
            for suite in (many, one):
                per_run[suite.name] = min(run_once(gs, suite)[0] for _ in range(args.repeat))
            marginal = (per_run["empty-60"] - per_run["empty-1"]) / 59
            direct = min(direct_fork_marginal(many, one) for _ in range(args.repeat))
            print("\nempty files, --cpu-slots 1: marginal cost per file")
            print(f"  gpusched run                 {marginal * 1000:7.1f} ms")
            print(f"  pytest.main forked directly  {direct * 1000:7.1f} ms")
            print(f"  runner overhead per file     {(marginal - direct) * 1000:7.1f} ms")
    print(f"\nload after: {load()}")
    print("\ntargets:")
    if "torch" in results:
        for run in ("first", "repeat"):
            ratio = results["torch first" if run == "first" else "torch"]
            print(f"  torch-conftest {run} run/pytest {ratio:.2f}x <= 1.5x: "
                  f"{'met' if ratio <= 1.5 else 'NOT met'}")  # fmt: skip
        ok = results["torch_off"] >= 5
        print(f"  torch-conftest off/gpusched {results['torch_off']:.2f}x >= 5x: "
              f"{'met' if ok else 'NOT met'}")  # fmt: skip
    if "click" in results:
        for run in ("first", "repeat"):
            ratio = results["click first" if run == "first" else "click"]
            print(f"  click {run} run/pytest {ratio:.2f}x <= 1.0x: "
                  f"{'met' if ratio <= 1.0 else 'NOT met'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
