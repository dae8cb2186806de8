"""A watcher that kills what a local Ray cluster left when the test process died.

Ray shares the fate of most of its processes with the driver that started the
cluster, but not all: killed with SIGKILL, a pytest process leaves Ray's
dashboard and runtime-env agents running (seen with Ray 2.60). Before the
cluster starts, :func:`start_reaper` puts a tag in the environment every Ray
process inherits and starts this module in a session of its own, reading a
pipe from the test process. The pipe closes when the test process closes it
(the cluster was shut down) or dies. Meanwhile the reaper notes, every two
seconds, the processes that carry the tag and their descendants (Ray's agents
rewrite their process title, which blanks the environment ``/proc`` shows of
them); once the pipe closes it kills those still alive, and exits.

Run as ``python -m rl_e2e.reaper VARIABLE TAG``; uses psutil only.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Reaper", "kill_and_wait", "start_reaper", "sweep"]

TAG_VARIABLE = "RL_E2E_CLUSTER_TAG"


SETTLED_S = 1.0  # a process this old has exec'd if it ever will: its environment is final


def _tagged_trees(
    variable: str, tag: str, untagged: set[tuple[int, float]] | None = None
) -> dict[int, float]:
    """Processes carrying the tag, and all their descendants: pid -> creation time.

    Descendants count whatever their environment shows: Ray's agents rewrite
    their process title, which blanks what ``/proc/PID/environ`` shows of them.
    One pass over the process table (psutil's ``children`` would make one per
    tagged process). ``untagged``: (pid, creation time) of settled processes
    found without the tag, kept by the caller between polls so that their
    environment is read once, not every poll (reading it is most of a poll's cost).
    """
    import psutil

    me = os.getpid()
    now = time.time()
    created: dict[int, float] = {}
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for proc in psutil.process_iter(["ppid", "create_time"]):
        info = proc.info
        key = (proc.pid, info["create_time"])
        if proc.pid == me or info["create_time"] is None:
            continue
        created[proc.pid] = info["create_time"]
        children.setdefault(info["ppid"], []).append(proc.pid)
        if untagged is not None and key in untagged:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(variable) == tag:
                roots.append(proc.pid)
            elif untagged is not None and now - info["create_time"] > SETTLED_S:
                untagged.add(key)
    found: dict[int, float] = {}
    stack = roots
    while stack:
        pid = stack.pop()
        if pid not in found and pid in created:
            found[pid] = created[pid]
            stack.extend(children.get(pid, ()))
    return found


def sweep(known: dict[int, float], variable: str, tag: str) -> int:
    """Kill the ``known`` processes still alive (same pid, same creation time) and every
    process carrying the tag now; return how many."""
    import psutil

    targets = []
    for pid, created in {**known, **_tagged_trees(variable, tag)}.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                targets.append(proc)
    kill_and_wait(targets, timeout_s=5)
    return len(targets)


def kill_and_wait(processes: Sequence[Any], timeout_s: float = 10) -> None:
    """SIGKILL each of ``processes`` (psutil processes; those already gone are skipped) and
    wait up to ``timeout_s`` for them to exit."""
    import psutil

    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(processes, timeout=timeout_s)


@dataclass
class Reaper:
    """The running reaper of one cluster; :meth:`close` after the cluster is shut down."""

    variable: str
    tag: str
    process: subprocess.Popen[bytes]

    def close(self, timeout_s: float = 30) -> None:
        """Let the reaper sweep what is left of the cluster, and wait for it."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_reaper(variable: str = TAG_VARIABLE) -> Reaper:
    """Tag this process's environment for the processes it starts next; start the reaper.

    The caller starts Ray after this (its processes inherit the tag) and
    removes the tag from ``os.environ`` once they are up.
    """
    tag = uuid.uuid4().hex
    env = {name: value for name, value in os.environ.items() if name != variable}
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_e2e.reaper", variable, tag],
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,  # outlives a group kill of the test process
    )
    os.environ[variable] = tag
    return Reaper(variable, tag, process)


def main(argv: list[str], poll_s: float = 2.0) -> int:
    """Note the cluster's processes every ``poll_s`` until the pipe closes, then kill them."""
    variable, tag = argv
    known: dict[int, float] = {}
    untagged: set[tuple[int, float]] = set()
    stdin = sys.stdin.buffer.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], poll_s)
        if ready and not os.read(stdin, 4096):
            break  # the test process closed the pipe, or died
        known.update(_tagged_trees(variable, tag, untagged))
    sweep(known, variable, tag)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
