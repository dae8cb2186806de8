"""Items 1-3: escaped processes, a job that ignores SIGTERM, crashes mid-test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import scenarios
from deadlines import hang_guard
from faultkit import alive

from gpusched.execution.proctree import TAG_VARIABLE, kill_job

DAEMON = """
import os, sys, time
os.setsid()
parent = os.getpid()
if os.fork():
    os._exit(0)
os.setpgrp()
while os.getppid() == parent:  # orphaned only once the forking parent has exited
    time.sleep(0.01)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(300)
"""
ROOT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], check=True)
time.sleep(300)
"""


@pytest.mark.timeout(hang_guard(60))
def test_kill_job_finds_escapees_by_tag_and_descent(tmp_path):
    """kill_job alone: a setsid child (a descendant) and a double-forked daemon (the tag only)."""
    tag = f"faults-{time.monotonic_ns()}"
    pid_file = tmp_path / "daemon.pid"
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT, DAEMON, str(pid_file)],
        env={**os.environ, TAG_VARIABLE: tag},
        process_group=0,
    )
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and root.poll() is None
            time.sleep(0.05)
        daemon_pid = int(pid_file.read_text())
        assert daemon_pid not in {p.pid for p in psutil.Process(root.pid).children(recursive=True)}
        report = kill_job(root.pid, root.pid, tag, grace=1.0)
        assert report.survivors == ()
        assert daemon_pid in report.pids and root.pid in report.pids
        assert report.found == len(report.pids) >= 3
        assert alive(sorted(report.pids)) == []
        assert root.wait(5) == -signal.SIGTERM
    finally:
        kill_job(root.pid if root.poll() is None else None, root.pid, tag, grace=0.0)
        root.wait()


@pytest.fixture(scope="module")
def kill_observations():
    return scenarios.kills()


@pytest.mark.timeout(hang_guard(120))
def test_escaped_processes_are_killed_before_the_card_is_reused(kill_observations, checked):
    escape = kill_observations[0]
    checked(escape)
    assert len(escape.details["escaped"]) == 2 and escape.details["living"] == []
    run = escape.run
    assert (
        "timed out after 6s in test_escape.py::test_escape" in run.file("test_escape.py")["message"]
    )
    assert run.file("test_next.py")["cards"] == run.file("test_escape.py")["cards"] == ["0"]


@pytest.mark.timeout(hang_guard(120))
def test_sigterm_ignoring_job_gets_sigkill_after_grace(kill_observations, checked):
    ignores = kill_observations[1]
    checked(ignores)
    entry = ignores.run.file("test_ignores_term.py")
    assert entry["returncode"] == -signal.SIGKILL
    assert ignores.run.tests("test_ignores_term.py") == {"test_ignores_sigterm": "timeout"}


@pytest.mark.timeout(hang_guard(120))
def test_test_code_may_call_setpgrp(kill_observations, checked):
    checked(kill_observations[2])
    assert kill_observations[2].run.code == 1  # the two timeouts


@pytest.mark.timeout(hang_guard(120))
def test_crashes_keep_finished_outcomes_and_the_run_goes_on(checked):
    observations = scenarios.crashes()
    for observation in observations:
        checked(observation)
    run = observations[0].run
    assert run.tests("test_segv.py") == {
        "test_before": "passed",
        "test_segfault": "crashed",
        "test_after": "not run",
    }
    assert run.tests("test_exit.py") == {
        "test_exit_mid_test": "crashed",
        "test_never_reached": "not run",
    }
    assert run.file("test_exit.py")["returncode"] == 3
    assert run.file("test_abort.py")["returncode"] == -signal.SIGABRT
    assert run.last_line == "gpusched: 3 passed, 3 failed, 0 skipped"


QUITTER = """
import os, sys, time
from pathlib import Path
# A helper in the job's process group that ends by itself 1 s after the kill began (as
# multiprocessing's resource tracker ends when its parent is gone), next to one that would linger.
go = Path(sys.argv[1])
if os.fork() == 0:
    while not go.exists():
        time.sleep(0.02)
    time.sleep(1.0)
    os._exit(0)
if os.fork() == 0:
    time.sleep(300)
    os._exit(0)
"""


@pytest.mark.timeout(hang_guard(60))
def test_settle_window_does_not_count_helpers_that_end_by_themselves(tmp_path):
    tag = f"settle-{time.monotonic_ns()}"
    go = tmp_path / "go"
    root = subprocess.Popen(
        [sys.executable, "-c", QUITTER, str(go)],
        env={**os.environ, TAG_VARIABLE: tag},
        process_group=0,
    )
    assert root.wait(30) == 0  # pytest itself has exited; its two helpers are still alive
    try:
        # The quitter ends 1 s after this, inside the 3 s window: seen by the first scan
        # however slow the machine is, and gone before the kill.
        go.touch()
        report = kill_job(None, root.pid, tag, grace=1.0, settle=3.0)
        assert report.survivors == ()
        assert report.found == 1, "only the lingering helper was left behind"
        assert len(report.pids) == 2 and alive(sorted(report.pids)) == []
    finally:
        kill_job(None, root.pid, tag, grace=0.0)
