"""Figures of the rl_e2e plugin: cluster scope, how soon a hang is reported, what is left.

    python bench/e2e_fixtures.py            # every figure
    python bench/e2e_fixtures.py scope hang # some (scope, hang, leftovers, imports)

- scope: one suite of 4 modules x 5 tests on ``e2e_ray``, run with
  ``rl_e2e_ray_scope = module`` and ``= session`` side by side; wall seconds and
  Ray starts of each, and their ratio.
- hang: seconds from a hang's timeout to its report, (a) the runner's own
  timeout (``run_distributed(timeout_s=T)``) and (b) pytest-timeout firing in a
  test on ``e2e_distributed`` (from pytest-timeout's deadline to the test's
  report); target at most 5 s. The report must carry every rank's stack.
- leftovers: processes left (psutil) after a hung runner, after a pytest run
  killed with SIGKILL in the middle of a test holding a Ray cluster and two
  ranks, and after a failed test in a shared cluster that left an actor.
- imports: the modules a plain pytest run imports with the plugin on and off
  (``python -X importtime -m pytest -s``: without ``-s`` pytest's capture swallows
  what importtime writes while conftests load), and whether ``rl_e2e`` imports ``trainer`` or
  ``gpusched``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFTEST = 'pytest_plugins = ["rl_e2e.plugin"]\n'


def _pytest(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _repo(files: dict[str, str], ini: str = "") -> Path:
    root = Path(tempfile.mkdtemp(prefix="e2ebench-"))
    (root / "conftest.py").write_text(CONFTEST)
    (root / "pytest.ini").write_text(f"[pytest]\n{ini}")
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    return root


# --- scope --------------------------------------------------------------------------------

_MODULE = """
    import ray

    @ray.remote(num_cpus=1)
    def square(x):
        return x * x
{tests}
"""
_TEST = """
    def test_{i}(e2e_ray):
        assert ray.get(square.remote({i})) == {i} * {i}
"""


def scope() -> list[str]:
    tests = "".join(_TEST.format(i=i) for i in range(5))
    files = {f"test_m{m}.py": _MODULE.format(tests=tests) for m in range(4)}
    rows = []
    seconds = {}
    for name in ("module", "session"):
        root = _repo(files, f"rl_e2e_ray_scope = {name}\n")
        t0 = time.monotonic()
        done = _pytest(root, "-q")
        seconds[name] = time.monotonic() - t0
        assert done.returncode == 0, done.stdout[-3000:]
        starts = 4 if name == "module" else 1
        rows.append(f"| {name} | 20 | {starts} | {seconds[name]:.1f} |")
    rows.append(f"\nsession against module: {seconds['session'] / seconds['module']:.2f}x the time")
    per_start = (seconds["module"] - seconds["session"]) / 3
    rows.append(f"one Ray start and stop: about {per_start:.1f} s")
    return ["| scope | tests | Ray starts | seconds |", "|---|---|---|---|", *rows]


# --- hang ---------------------------------------------------------------------------------


def _hang(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)
    dist.barrier()


_HANGING = """
    import time
    import pytest
    import torch.distributed as dist

    def hang(rank, world_size):
        if rank == 1:
            time.sleep(3600)
        dist.barrier()

    @pytest.mark.timeout({timeout})
    def test_hangs(e2e_distributed):
        e2e_distributed(hang, 2)
"""
_TIMES = """
    import json, os, time

    def pytest_runtest_logstart(nodeid, location):
        with open(os.environ["TIMES"], "a") as out:
            out.write(json.dumps({"start": time.time()}) + "\\n")

    def pytest_runtest_logreport(report):
        if report.when == "call":
            with open(os.environ["TIMES"], "a") as out:
                out.write(json.dumps({"report": time.time()}) + "\\n")
"""


def hang() -> list[str]:
    from rl_e2e.distributed import DistributedTimeoutError, run_distributed

    rows = []
    timeout = 30.0
    t0 = time.monotonic()
    try:
        run_distributed(_hang, 2, timeout_s=timeout)
    except DistributedTimeoutError as err:
        late = time.monotonic() - t0 - timeout
        stacks = sum("_hang" in err.stacks.get(rank, "") for rank in (0, 1))
        rows.append(f"| the runner's timeout ({timeout:g} s) | {late:.2f} | {stacks} of 2 |")
    root = _repo({"test_hang.py": _HANGING.format(timeout=int(timeout))})
    (root / "conftest.py").write_text(CONFTEST + textwrap.dedent(_TIMES))
    times = root / "times.jsonl"
    os.environ["TIMES"] = str(times)
    done = _pytest(root, "-q")
    events = [json.loads(line) for line in times.read_text().splitlines()]
    start = next(e["start"] for e in events if "start" in e)
    report = next(e["report"] for e in events if "report" in e)
    stacks = len(re.findall(r"Captured stderr rank \d stack at the timeout", done.stdout))
    named = "in hang" in done.stdout
    rows.append(
        f"| pytest-timeout ({timeout:g} s, signal method) | {report - start - timeout:.2f} | "
        f"{stacks} of 2{' (naming hang)' if named else ''} |"
    )
    return [
        "| hang cut by | seconds from the timeout to the report | stacks |",
        "|---|---|---|",
        *rows,
    ]


# --- leftovers ----------------------------------------------------------------------------

_KILLED = """
    import os, time
    import ray
    import torch.distributed as dist

    def hang(rank, world_size):
        print("rank up", flush=True)
        time.sleep(3600)

    def test_killed_in_the_middle(e2e_ray, e2e_distributed):
        open(os.environ["TEMP_DIR_OUT"], "w").write(str(e2e_ray.temp_dir))
        e2e_distributed(hang, 2)
"""
_SHARED = """
    import ray

    @ray.remote(num_cpus=2)
    class Hog:
        def ping(self):
            return 1

    def test_leaves_an_actor_and_fails(e2e_ray):
        hog = Hog.remote()
        assert ray.get(hog.ping.remote()) == 1
        assert False, "fails on purpose, with its actor holding every CPU"

    @ray.remote(num_cpus=1)
    def one():
        return 1

    def test_the_next_test_still_gets_a_cpu(e2e_ray):
        assert ray.get(one.remote(), timeout=120) == 1
"""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=15)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _kept(proc: psutil.Process) -> bool:
    """This process's multiprocessing resource tracker or fork server: one of each, kept by design.

    The ranks the server forked show its command line too, but not this parent.
    """
    command = " ".join(proc.cmdline())
    server = "multiprocessing.forkserver" in command and proc.ppid() == os.getpid()
    return "multiprocessing.resource_tracker" in command or server


def _naming(text: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or []):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def leftovers() -> list[str]:
    from rl_e2e.distributed import DistributedTimeoutError, run_distributed

    rows = []
    try:
        run_distributed(_hang, 2, timeout_s=20)
    except DistributedTimeoutError:
        pass
    left = [p for p in _alive(_descendants(os.getpid())) if not _kept(p)]
    rows.append(f"| a hung runner, after its timeout | {len(left)} |")

    root = _repo({"test_killed.py": _KILLED})
    out = root / "temp_dir.txt"
    env = {**os.environ, "TEMP_DIR_OUT": str(out)}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={root}/bt"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ranks_up = [p for p in root.glob("bt/**/ranks1/rank*.out") if p.read_text()]
        if out.exists() and len(ranks_up) == 2:
            break
        time.sleep(0.5)
    tree = _descendants(run.pid)
    run.send_signal(signal.SIGKILL)
    run.wait()
    time.sleep(5)
    left = _alive(tree)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            print(f"left after SIGKILL: {proc.pid} {' '.join(proc.cmdline())[:150]}")
    temp_dir = out.read_text() if out.exists() else "?"
    rows.append(
        f"| pytest killed with SIGKILL mid-test ({len(tree)} processes: Ray and 2 ranks) | "
        f"{len(left)} (naming its Ray temp dir: {len(_naming(temp_dir))}) |"
    )

    root = _repo({"test_shared.py": _SHARED}, "rl_e2e_ray_num_cpus = 2\n")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tree = []
    while run.poll() is None:
        tree = list({p.pid: p for p in tree + _descendants(run.pid)}.values())
        time.sleep(0.5)
    output = run.stdout.read() if run.stdout else ""
    counts = re.search(r"(\d+ failed, \d+ passed)", output)
    rows.append(
        f"| a failed test left an actor holding every CPU in the shared cluster "
        f"({counts.group(1) if counts else output[-200:]}) | {len(_alive(tree))} |"
    )
    return ["| after | processes left |", "|---|---|", *rows]


# --- imports ------------------------------------------------------------------------------


def _importtime(root: Path) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", done.stderr, re.M)
    return {name.split(".")[0] for name in names}


def imports() -> list[str]:
    trivial = {"test_plain.py": "def test_plain():\n    assert True\n"}
    off = _repo(trivial)
    (off / "conftest.py").write_text("")
    on = _repo(trivial)
    rows = []
    for name, root in (("off", off), ("on", on)):
        found = _importtime(root)
        heavy = sorted(found & {"ray", "torch", "transformers", "tensordict"})
        rows.append(f"| plugin {name} | {len(found)} | {', '.join(heavy) or 'none'} |")
    upward = []
    for path in sorted((REPO / "rl_e2e").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            upward += [
                f"{path.name}: {n}" for n in names if n.split(".")[0] in ("trainer", "gpusched")
            ]
    return [
        "| pytest run | top-level modules imported | of ray, torch, transformers, tensordict |",
        "|---|---|---|",
        *rows,
        f"\nrl_e2e imports of trainer or gpusched: {len(upward)} {upward or ''}",
    ]


FIGURES = {"scope": scope, "hang": hang, "leftovers": leftovers, "imports": imports}


def main(argv: list[str]) -> int:
    wanted = argv or list(FIGURES)
    unknown = [name for name in wanted if name not in FIGURES]
    if unknown:
        print(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
        return 2
    for name in wanted:
        t0 = time.monotonic()
        print(f"\n## {name}\n")
        print("\n".join(FIGURES[name]()))
        print(f"\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
