"""``CpuMeter`` on real processes: what a job's process tree used, read with psutil.

Each child burns a fixed amount of CPU time (``time.process_time``), however
loaded the machine is, so the figures checked are CPU seconds, never wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
from deadlines import hang_guard

from gpusched.execution.proctree import TAG_VARIABLE, CpuMeter

BURN = 0.5  # CPU seconds each burner uses

BURNER = f"""
import sys, time
while time.process_time() < {BURN}:
    pass
print("burnt", flush=True)
sys.stdin.readline()  # idle until told to end
"""


def python(source: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_line(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == line


def end(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(hang_guard(30))


def test_a_busy_process_is_measured_and_an_idle_one_barely():
    meter = CpuMeter()
    busy, idle = python(BURNER), python("import sys\nprint('up', flush=True)\nsys.stdin.readline()")
    try:
        meter.watch("busy", busy.pid, None)
        meter.watch("idle", idle.pid, None)
        wait_line(busy, "burnt")
        wait_line(idle, "up")
        meter.sample()
        meter.sample()
        used, rested = meter.stop("busy"), meter.stop("idle")
    finally:
        end(busy)
        end(idle)
    assert used is not None and rested is not None
    assert used.seconds >= BURN * 0.9  # what it burnt after watch began, start-up aside
    assert rested.seconds < BURN / 2
    assert used.mean > rested.mean
    assert used.peak >= used.mean > 0


def test_a_child_that_ended_counts_through_the_parent_that_reaped_it():
    meter = CpuMeter()
    parent = python(
        f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {BURNER!r}], input="\\n", text=True,
                       stdout=subprocess.DEVNULL, check=True)
        print("reaped", flush=True)
        sys.stdin.readline()
        """
    )
    try:
        meter.watch("job", parent.pid, None)
        meter.sample()  # sees the child alive, or not at all: either way it counts
        wait_line(parent, "reaped")
        meter.sample()
        use = meter.stop("job")
    finally:
        end(parent)
    assert use is not None
    assert BURN * 0.9 <= use.seconds < BURN * 4  # counted once, not twice


def test_a_child_its_parent_never_waits_for_still_counts():
    """Ray's raylet ignores SIGCHLD: the kernel reaps its workers, and their time is in no
    parent's reaped-children figure, so what the meter last saw of them must count."""
    meter = CpuMeter()
    parent = python(
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", {BURNER!r}], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        sys.stdin.readline()  # the meter has seen the child: let it end
        child.stdin.close()
        while True:  # reaped by the kernel: gone from /proc, no exit status for anyone
            try:
                with open(f"/proc/{{child.pid}}/stat") as stat:
                    stat.read()
            except FileNotFoundError:
                break
            time.sleep(0.01)
        print("gone", flush=True)
        sys.stdin.readline()
        """
    )
    try:
        meter.watch("job", parent.pid, None)
        wait_line(parent, "burnt")
        meter.sample()  # the child alive, with its 0.5 s
        assert parent.stdin is not None
        parent.stdin.write("\n")
        parent.stdin.flush()
        wait_line(parent, "gone")
        meter.sample()
        use = meter.stop("job")
    finally:
        end(parent)
    assert use is not None
    assert BURN * 0.9 <= use.seconds < BURN * 4


@pytest.mark.parametrize("root_exit", [None, 0.01], ids=["running", "root-exited"])
def test_a_tagged_process_that_left_the_tree_is_counted(root_exit):
    """Ray's daemons start their own session and outlive their parent; they keep the tag.
    Their time is in no wait status of the root: the scans' larger figure stands."""
    meter = CpuMeter()
    tag = f"cpu-meter-test-{os.getpid()}"
    escapee = python(BURNER, start_new_session=True, env={**os.environ, TAG_VARIABLE: tag})
    root = python("import sys\nprint('up', flush=True)\nsys.stdin.readline()")
    try:
        meter.watch("job", root.pid, tag)
        wait_line(escapee, "burnt")
        wait_line(root, "up")
        meter.sample()
        if root_exit is not None:
            meter.exited("job", root_exit)  # what the root itself used
        use = meter.stop("job")
    finally:
        end(escapee)
        end(root)
    assert use is not None and use.seconds >= BURN * 0.9


def test_a_job_no_scan_saw_is_not_measured():
    meter = CpuMeter()
    proc = python("import sys\nsys.stdin.readline()")
    try:
        meter.watch("job", proc.pid, None)
        assert meter.stop("job") is None  # no figure rather than a wrong zero
        assert meter.stop("never watched") is None
    finally:
        end(proc)


def test_a_job_no_scan_saw_is_measured_by_its_roots_exit_figure():
    """A fork server's child: its wait status holds what it and the children it reaped used."""
    meter = CpuMeter()
    proc = python(f"import time\nwhile time.process_time() < {BURN}:\n    pass\n")
    meter.watch("job", proc.pid, None)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped here, not by Popen
    meter.exited("job", usage.ru_utime + usage.ru_stime)
    use = meter.stop("job")
    assert use is not None
    assert BURN * 0.9 <= use.seconds < BURN * 4
    assert use.peak >= use.mean > 0


class CountingMeter(CpuMeter):
    """A meter that tells when its own thread has scanned after a given point."""

    def __init__(self) -> None:
        super().__init__(interval=0.05)
        self.scanned = threading.Event()

    def sample(self) -> None:
        super().sample()
        self.scanned.set()


def test_the_meter_thread_scans_while_a_job_is_watched():
    meter = CountingMeter()
    meter.start()
    proc = python(BURNER)
    try:
        meter.watch("job", proc.pid, None)
        wait_line(proc, "burnt")
        meter.scanned.clear()
        assert meter.scanned.wait(hang_guard(30))  # a scan after the burn, by the thread
        use = meter.stop("job")
    finally:
        meter.close()
        end(proc)
    assert use is not None and use.seconds >= BURN * 0.9
