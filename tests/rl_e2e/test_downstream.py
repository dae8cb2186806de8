"""Proof from outside: ``examples/downstream``, an RL repository of its own, uses the plugin.

``minirl`` imports nothing of ``trainer`` or ``gpusched``; it turns the plugin
on in its root ``conftest.py`` and configures it in its ``pyproject.toml``. Each
test here runs its tests as its users would, in a subprocess started in its
directory (its rootdir, conftest and ini), with ``pytest`` or ``gpusched run``,
then checks that nothing the run started is still alive. ``failing/`` holds
tests meant to fail or hang: there the reports themselves are checked, on the
console and in the JUnit XML. Needs ``pip install -e examples/downstream``
(``setup.sh`` does it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

# Four runs of 30 s to 3 min each on a quiet machine (failing/ waits out a 60 s and a
# 10 s hang); the two failing/ runs go side by side.
RUN_BOUND_S = 200
pytestmark = pytest.mark.timeout(hang_guard(4 * RUN_BOUND_S))

REPO = Path(__file__).resolve().parents[2]
DOWNSTREAM = REPO / "examples" / "downstream"
GPUSCHED = str(Path(sys.executable).with_name("gpusched"))
MARK_VAR = "DOWNSTREAM_RUN_MARK"  # every process a run starts inherits it
KEPT_RAY_VARS = {"RAY_USAGE_STATS_ENABLED"}


@dataclass
class Run:
    """A finished run of the downstream's tests: its output and what it left alive."""

    returncode: int
    output: str
    leftovers: list[str]

    @property
    def last_line(self) -> str:
        return self.output.rstrip().splitlines()[-1]


def _leftovers(mark: str, ray_tmp: str, wait_s: float) -> list[str]:
    """Processes of the run still alive after ``wait_s`` at most.

    Every process a run starts (pytest, gpusched's children, the ranks, Ray's
    raylet, GCS and workers) inherits ``MARK_VAR``, whatever its command line;
    a process that cleared its environment is still found by the Ray temp dir
    its command line names.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                cmdline = " ".join(proc.info["cmdline"] or [])
                if ray_tmp in cmdline or proc.environ().get(MARK_VAR) == mark:
                    found.append(f"{proc.pid}: {cmdline[:160]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@dataclass
class Started:
    """A run of the downstream's tests under way (its output goes to a file)."""

    process: subprocess.Popen
    mark: str
    ray_tmp: str
    output: Path


def _start(*command: str, output: Path) -> Started:
    """Start ``command`` in the downstream repository, on CPU, with a Ray temp root of its own."""
    mark = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="ds", dir="/tmp")  # short: Ray's socket paths
    # Ray's usage-stats choice is the machine's (``ray disable-usage-stats`` writes it for
    # all runs), not this session's: kept, an idle dashboard is not started for each cluster.
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTEST_", "GPUSCHED_", "RAY_")) or name in KEPT_RAY_VARS
    }
    env.update({MARK_VAR: mark, "RAY_TMPDIR": ray_tmp, "CUDA_VISIBLE_DEVICES": ""})
    with output.open("w") as out:
        process = subprocess.Popen(
            command, cwd=DOWNSTREAM, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
    return Started(process, mark, ray_tmp, output)


def _finish(started: Started) -> Run:
    """Wait for the run (killed past its bound), then look for what it left alive."""
    try:
        try:
            code = started.process.wait(timeout=hang_guard(RUN_BOUND_S))
        except subprocess.TimeoutExpired:
            started.process.kill()
            started.process.wait()
            raise
        leftovers = _leftovers(started.mark, started.ray_tmp, hang_guard(5))
    finally:
        shutil.rmtree(started.ray_tmp, ignore_errors=True)
    return Run(code, started.output.read_text(), leftovers)


def _run(*command: str) -> Run:
    """Run ``command`` in the downstream repository, on CPU, with a Ray temp root of its own."""
    with tempfile.TemporaryDirectory(prefix="ds-out") as out:
        return _finish(_start(*command, output=Path(out) / "output"))


@pytest.fixture(scope="module")
def failing_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Started, Path]]]:
    """``failing/`` under pytest and under gpusched, started together: most of each run is
    two hangs waited out (60 s and 10 s), which the two runs then wait out side by side."""
    root = tmp_path_factory.mktemp("failing")
    junit = {name: root / f"{name}.xml" for name in ("pytest", "gpusched")}
    commands = {
        "pytest": (sys.executable, "-m", "pytest", "failing", f"--junitxml={junit['pytest']}"),
        "gpusched": (
            GPUSCHED, "run", "failing", "--simulate-gpus", "2", "--junitxml", str(junit["gpusched"])
        ),
    }  # fmt: skip
    runs = {
        name: (_start(*command, output=root / f"{name}.out"), junit[name])
        for name, command in commands.items()
    }
    yield runs
    for started, _ in runs.values():  # a test that failed early left its run going
        if started.process.poll() is None:
            started.process.kill()
            started.process.wait()
        shutil.rmtree(started.ray_tmp, ignore_errors=True)


def _blocks(output: str) -> dict[str, str]:
    """Each failed test's part of a report, by test name (pytest's and gpusched's headers)."""
    parts = re.split(r"^_+ (?:\S+::)?(test_\w+) _+$", output, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _section(block: str, name: str) -> str:
    """The text of the report section ``name`` in ``block`` ("" when it is missing)."""
    found = re.search(
        rf"^-{{5,}} {re.escape(name)} -{{5,}}\n(.*?)(?=^-{{5,}} |^_{{3,}} |^={{3,}} |\Z)",
        block,
        flags=re.MULTILINE | re.DOTALL,
    )
    return found.group(1) if found else ""


def _check_console(output: str) -> None:
    """The failing tests' reports name what failed and carry each rank's or worker's output."""
    blocks = _blocks(output)
    assert sorted(blocks) == [
        "test_a_hang_cut_by_pytest_timeout",
        "test_a_hang_cut_by_the_runners_timeout",
        "test_a_rank_raises",
        "test_a_ray_test_fails_after_a_worker_printed",
    ], output[-5000:]

    raised = blocks["test_a_rank_raises"]
    assert "DistributedRankError: rank 0 raised ValueError: rank 0 found a NaN" in raised
    assert "rank 1 reached the barrier" in _section(raised, "Captured stdout rank 1 call")
    assert "found a NaN" in _section(raised, "Captured stderr rank 0 call")

    cut = blocks["test_a_hang_cut_by_pytest_timeout"]
    assert "Timeout (>60.0s) from pytest-timeout" in cut
    assert "in _rank_one_hangs" in _section(cut, "Captured stderr rank 0 stack at the timeout call")
    assert "in wait_for_weights" in _section(
        cut, "Captured stderr rank 1 stack at the timeout call"
    )

    timed_out = blocks["test_a_hang_cut_by_the_runners_timeout"]
    assert "run_distributed timed out after 10 s; ranks still running: [0, 1]" in timed_out
    stack = timed_out.split("Stack of rank 1 at the timeout:", 1)[1]
    assert "in wait_for_weights" in stack.split("Stack of rank", 1)[0]

    ray_failed = blocks["test_a_ray_test_fails_after_a_worker_printed"]
    assert "AssertionError: rewards are not lengths" in ray_failed
    assert "scoring 3 texts" in _section(ray_failed, "Captured stderr ray worker logs call")


def _check_junit(path: Path) -> None:
    """The same outputs in the JUnit XML, where pytest files them (system-out / system-err)."""
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        text = {child.tag: child.text or "" for child in case}
        failure = case.find("failure")
        if failure is not None:
            text["failure"] += failure.get("message", "")
        cases[case.get("name")] = text
    assert "rank 1 reached the barrier" in cases["test_a_rank_raises"]["system-out"]
    assert "found a NaN" in cases["test_a_rank_raises"]["system-err"]
    assert "in wait_for_weights" in cases["test_a_hang_cut_by_pytest_timeout"]["system-err"]
    timed_out = cases["test_a_hang_cut_by_the_runners_timeout"]
    assert "Stack of rank 1 at the timeout" in timed_out["failure"]
    assert "in wait_for_weights" in timed_out["system-err"]
    ray_failed = cases["test_a_ray_test_fails_after_a_worker_printed"]
    assert "scoring 3 texts" in ray_failed["system-err"]
    for name in ("test_leaves_an_actor_holding_every_cpu", "test_the_next_test_still_gets_a_cpu"):
        assert "failure" not in cases[name], name  # the plugin removed the hog in between


def test_the_suite_passes_under_pytest():
    """``python -m pytest`` there: the plugin is on, its runtime env configured, all pass."""
    run = _run(sys.executable, "-m", "pytest", "-rs")
    assert run.returncode == 0, run.output[-5000:]
    assert re.search(r"^=+ 4 passed, 1 skipped in ", run.last_line), run.output[-3000:]
    assert re.search(
        r"^rl_e2e: runtime env from the layered runtime env of the rl_e2e_env_\* options: "
        r"env_vars: .*MINIRL_LOG_LEVEL=INFO.*TOKENIZERS_PARALLELISM=false",
        run.output,
        flags=re.MULTILINE,
    ), run.output[:3000]
    assert re.search(r"^SKIPPED \[1\] .*needs 1 (CUDA )?GPU", run.output, flags=re.MULTILINE)
    assert run.leftovers == []


def test_the_suite_passes_under_gpusched():
    """``gpusched run tests --simulate-gpus 2`` there: the same counts, the GPU test skipped.

    Unless the machine has a real card: simulated card 0 is then handed to the
    GPU test in ``CUDA_VISIBLE_DEVICES`` and it really runs on that card.
    """
    from gpusched.inventory import nvml_cards

    run = _run(GPUSCHED, "run", "tests", "--simulate-gpus", "2")
    assert run.returncode == 0, run.output[-5000:]
    expected = (
        "5 passed, 0 failed, 0 skipped" if nvml_cards()[0] else "4 passed, 0 failed, 1 skipped"
    )
    assert run.last_line == f"gpusched: {expected}", run.output[-5000:]
    assert run.leftovers == []


def test_failing_reports_under_pytest(failing_runs):
    """``failing/`` with pytest: each report carries the ranks' and workers' output; (e) passes."""
    started, junit = failing_runs["pytest"]
    run = _finish(started)
    assert run.returncode == 1, run.output[-5000:]
    assert re.search(r"^=+ 4 failed, 2 passed in ", run.last_line), run.output[-3000:]
    _check_console(run.output)
    _check_junit(junit)
    assert run.leftovers == []


def test_failing_reports_under_gpusched(failing_runs):
    """The same reports reach gpusched's console and its merged JUnit XML."""
    started, junit = failing_runs["gpusched"]
    run = _finish(started)
    assert run.returncode == 1, run.output[-5000:]
    assert run.last_line == "gpusched: 2 passed, 4 failed, 0 skipped", run.output[-5000:]
    _check_console(run.output)
    _check_junit(junit)
    assert run.leftovers == []
