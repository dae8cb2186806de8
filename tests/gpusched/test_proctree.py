"""``kill_job`` waits for every process it found, not only for a scan that comes back empty.

A process that was signalled and is still exiting may stop showing its
environment (the kernel releases its memory early in exit), so a scan by tag
no longer sees it although it is alive (issue #23). These tests hide a real,
tagged child from every scan after the first one and check that ``kill_job``
still returns only once that child has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from deadlines import hang_guard

from gpusched.execution import proctree
from gpusched.execution.proctree import TAG_VARIABLE, kill_job

# Ends 0.5 s after its first SIGTERM, as a process that takes a moment to exit does;
# its exit status is the number of TERMs it got by then.
SLOW_TO_EXIT = """
import signal, sys, time
term_at = []
signal.signal(signal.SIGTERM, lambda *_: term_at.append(time.monotonic()))
print("ready", flush=True)
while not term_at or time.monotonic() - term_at[0] < 0.5:
    time.sleep(0.01)
sys.exit(len(term_at))
"""

# Ignores SIGTERM: only the KILL round ends it.
IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(300)
"""


# The interpreter binary itself, outside any virtual environment: started as a GPU image's
# venv python, whose site-packages load at start-up, the child ended by SIGTERM (-15)
# although its handler ran; these children need the standard library alone.
INTERPRETER = os.readlink("/proc/self/exe") if os.path.exists("/proc/self/exe") else sys.executable


def _start_tagged(source: str, tag: str) -> subprocess.Popen:
    """A python child in its own process group with ``tag``; returns once its handlers are set."""
    child = subprocess.Popen(
        [INTERPRETER, "-c", source],
        env={**os.environ, TAG_VARIABLE: tag},
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    return child


@pytest.fixture
def hidden_after_first_scan(monkeypatch):
    """Make the tag scan stop seeing ``pids`` after its first call, as for an exiting process."""
    pids: set[int] = set()
    calls = []
    scan = proctree.processes_with

    def processes_with(variable: str, value: str) -> list[psutil.Process]:
        calls.append(value)
        found = scan(variable, value)
        return found if len(calls) == 1 else [p for p in found if p.pid not in pids]

    monkeypatch.setattr(proctree, "processes_with", processes_with)
    return pids


def _tag() -> str:
    return f"proctree-{os.getpid()}-{time.monotonic_ns()}"


@pytest.mark.timeout(hang_guard(60))
def test_each_process_is_termed_once_while_it_exits():
    """A second TERM would reach a process in the middle of what it does on TERM (or, once
    Python has restored the default action as it finalises, end it with -15)."""
    tag = _tag()
    child = _start_tagged(SLOW_TO_EXIT, tag)
    try:
        report = kill_job(None, None, tag, grace=10.0)
        assert child.wait(timeout=hang_guard(5)) == 1, "TERMs received (exit status)"
        assert report.survivors == () and report.found == 1
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(hang_guard(60))
def test_a_process_hidden_from_the_tag_scan_is_waited_for(hidden_after_first_scan):
    tag = _tag()
    child = _start_tagged(SLOW_TO_EXIT, tag)
    hidden_after_first_scan.add(child.pid)
    try:
        report = kill_job(None, None, tag, grace=10.0)
        assert child.poll() == 1, "kill_job returned while the child was still exiting"
        assert report.survivors == ()
        assert report.found == 1 and child.pid in report.pids
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(hang_guard(60))
def test_a_hidden_process_that_ignores_term_gets_the_kill_round(hidden_after_first_scan):
    tag = _tag()
    child = _start_tagged(IGNORES_TERM, tag)
    hidden_after_first_scan.add(child.pid)
    try:
        report = kill_job(None, None, tag, grace=0.2)
        assert child.poll() == -signal.SIGKILL
        assert report.survivors == () and report.found == 1
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(hang_guard(60))
def test_a_hidden_process_that_cannot_be_killed_is_a_survivor(hidden_after_first_scan, monkeypatch):
    """Past ``bound`` s of KILL rounds, a tracked process still alive is reported, not forgotten."""
    tag = _tag()
    child = _start_tagged(IGNORES_TERM, tag)
    hidden_after_first_scan.add(child.pid)
    monkeypatch.setattr(proctree, "_signal_all", lambda *_: None)  # as if stuck in the kernel
    try:
        report = kill_job(None, None, tag, grace=0.1, bound=0.3)
        assert report.survivors == (child.pid,)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(hang_guard(60))
def test_waiting_for_an_exit_leaves_the_child_to_its_parent():
    """``_wait_exit`` returns as the process exits and never reaps it: the runner does that."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        started = time.monotonic()
        proctree._wait_exit([psutil.Process(child.pid)], 600.0)
        assert time.monotonic() - started < 300.0  # the exit ended the wait, not the bound
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert child.wait(5) == 3
    finally:
        child.kill()
        child.wait()
