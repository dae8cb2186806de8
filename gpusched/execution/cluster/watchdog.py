"""The backstop on each node: when its agent's process ends, no process of the run stays behind.

An agent normally kills its files itself (timeout, Ctrl-C on the driver, end of
the run). But an agent can die without a chance to: its node's raylet stops,
Ray kills the actor because the driver went away, the process crashes. So at
start each agent launches this watchdog, detached from it (a new session, not
its child), holding the read end of a pipe whose write end only the agent has.
When the pipe reaches end of file (the agent exited, however), the watchdog
kills every process whose job tag belongs to the agent's run on this node
(``PREFIX*``: its files, what they started, its fork server), then removes the
agent's temporary directories (``PATH...``: its work dir, the parent of its
files' ``RAY_TMPDIR``s), and exits. The processes go first, so that none of
them writes there again.

    python -m gpusched.execution.cluster.watchdog RUN_PREFIX [PATH...]  < pipe
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

from gpusched.execution.proctree import TAG_VARIABLE, processes_where

GRACE = 3.0


def run_processes(prefix: str) -> list[psutil.Process]:
    """Live processes whose job tag starts with ``prefix`` or is the fork server's ``fs-prefix``."""
    return processes_where(TAG_VARIABLE, lambda tag: tag.startswith((prefix, f"fs-{prefix}")))


def sweep(prefix: str, grace: float = GRACE) -> int:
    """TERM, then after ``grace`` s KILL, every process of the run on this node; how many there were."""
    procs = run_processes(prefix)
    seen = {proc.pid for proc in procs}
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while procs and time.monotonic() < deadline:
        time.sleep(0.1)
        procs = run_processes(prefix)
        seen.update(proc.pid for proc in procs)
    for _ in range(50):
        procs = run_processes(prefix)
        if not procs:
            break
        seen.update(proc.pid for proc in procs)
        for proc in procs:
            _signal(proc, signal.SIGKILL)
        time.sleep(0.1)
    return len(seen)


def _signal(proc: psutil.Process, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except psutil.Error:
        pass


def launch(prefix: str, paths: Sequence[str] = ()) -> int:
    """Start the watchdog for ``prefix``; return the write end of its pipe (close it to fire).

    Called by the agent. When it fires, the watchdog kills the run's processes
    on this node, then removes ``paths`` (directories, with what is in them).
    The descriptor is not inherited by anything the agent starts later
    (PEP 446), so only the agent's own exit closes it.
    """
    read_end, write_end = os.pipe()
    try:
        starter = subprocess.Popen(
            [sys.executable, "-m", "gpusched.execution.cluster.watchdog", prefix, *paths],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k != TAG_VARIABLE},
        )
    finally:
        os.close(read_end)
    starter.wait()  # it forks the watchdog and exits at once
    return write_end


def main(argv: list[str]) -> int:
    prefix, paths = argv[0], argv[1:]
    if os.fork():
        os._exit(0)  # the starter: the agent reaps it; the watchdog is nobody's child now
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    sweep(prefix)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
