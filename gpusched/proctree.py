"""Find and kill every process of a job, including ones that left its process group.

A job's processes are: members of its process group, descendants of its root
process, and any process whose environment carries the job's tag (Ray workers
and daemons call ``setsid()``/``setpgrp()`` and are reparented to init, but keep
the environment they inherited). Killing is TERM, a grace period, then KILL,
re-scanning each round because a dying tree can still fork.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

TAG_VARIABLE = "GPUSCHED_JOB_TAG"
_POLL = 0.05


@dataclass(frozen=True)
class KillReport:
    """What a kill found: how many processes it signalled, and pids still alive at the end.

    ``found`` leaves out processes that ended by themselves during the settle
    window (see :func:`kill_job`).

    ``pids`` are every process of the job seen alive during the kill (the GPU
    release check looks for them on the cards).
    """

    found: int
    survivors: tuple[int, ...]
    pids: frozenset[int] = frozenset()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes_with(variable: str, value: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment has ``variable=value``.

    Processes of other users cannot be read and are skipped: a job only ever
    starts processes as the user running gpusched.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(variable) == value and _alive(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment has ``GPUSCHED_JOB_TAG=tag``."""
    return processes_with(TAG_VARIABLE, tag)


def job_processes(root_pid: int | None, pgid: int | None, tag: str | None) -> list[psutil.Process]:
    """Every live process of the job, de-duplicated by pid."""
    procs: dict[int, psutil.Process] = {}
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            for proc in [root, *root.children(recursive=True)]:
                procs[proc.pid] = proc
        except psutil.Error:
            pass
    if pgid is not None:
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == pgid:
                    procs[proc.pid] = proc
            except (OSError, psutil.Error):
                continue
    if tag is not None:
        for proc in tagged_processes(tag):
            procs[proc.pid] = proc
    return [proc for proc in procs.values() if _alive(proc)]


def _signal_all(procs: Iterable[psutil.Process], pgid: int | None, sig: signal.Signals) -> None:
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def kill_job(
    root_pid: int | None,
    pgid: int | None,
    tag: str | None,
    grace: float,
    hurry: threading.Event | None = None,
    bound: float = 10.0,
    settle: float = 0.0,
) -> KillReport:
    """TERM the whole job, wait up to ``grace`` s (cut short when ``hurry`` is set), then KILL.

    With ``settle`` > 0, first give the job's processes that long to end by
    themselves: after a normal exit of pytest, helpers such as
    ``multiprocessing``'s resource tracker quit as soon as they notice their
    parent is gone, and are not counted as left behind.

    Returns once no process of the job is alive, or after ``bound`` s of KILL
    rounds with the pids that survived (a process stuck in the kernel).
    Pass ``root_pid=None`` once the root has been reaped: its pid may already
    belong to an unrelated process.
    Blocking: the asyncio runner calls it through ``asyncio.to_thread``.
    """
    procs = job_processes(root_pid, pgid, tag)
    seen = {proc.pid for proc in procs}
    settle_until = time.monotonic() + settle
    while procs and time.monotonic() < settle_until and not (hurry and hurry.is_set()):
        time.sleep(_POLL)
        procs = job_processes(root_pid, pgid, tag)
        seen.update(proc.pid for proc in procs)
    killed = {proc.pid for proc in procs}
    if not procs:
        return KillReport(0, (), frozenset(seen))

    def report(survivors: tuple[int, ...] = ()) -> KillReport:
        return KillReport(len(killed), survivors, frozenset(seen))

    _signal_all(procs, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (hurry and hurry.is_set()):
        procs = job_processes(root_pid, pgid, tag)
        seen.update(proc.pid for proc in procs)
        killed.update(proc.pid for proc in procs)
        if not procs:
            return report()
        _signal_all(procs, None, signal.SIGTERM)  # newcomers forked during the grace period
        time.sleep(_POLL)
    deadline = time.monotonic() + bound
    while True:
        procs = job_processes(root_pid, pgid, tag)
        seen.update(proc.pid for proc in procs)
        killed.update(proc.pid for proc in procs)
        if not procs:
            return report()
        if time.monotonic() > deadline:
            return report(tuple(sorted(proc.pid for proc in procs)))
        _signal_all(procs, pgid, signal.SIGKILL)
        time.sleep(_POLL)
