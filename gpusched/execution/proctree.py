"""Find and kill every process of a job, including ones that left its process group.

A job's processes are: members of its process group, descendants of its root
process, and any process whose environment carries the job's tag (Ray workers
and daemons call ``setsid()``/``setpgrp()`` and are reparented to init, but keep
the environment they inherited). Killing is TERM, a grace period, then KILL,
re-scanning each round because a dying tree can still fork.

A kill is over only when every process it ever found has exited (gone, or a
zombie), not merely when a fresh scan finds nothing: a process that is still
exiting may no longer show its environment (the kernel releases its memory
early in exit), so the scan by tag stops seeing it before it is gone (#23).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
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
    return processes_where(variable, lambda found: found == value)


def processes_where(variable: str, accept: Callable[[str], bool]) -> list[psutil.Process]:
    """Live processes (other than this one) with ``variable`` set to a value ``accept`` takes."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            value = proc.environ().get(variable)
            if value is not None and accept(value) and _alive(proc):
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


class _Found:
    """Every process a kill has found, across all its scans.

    ``scan`` returns the fresh scan together with the earlier finds that are
    still alive: a process that stops showing up in the scan (its environment
    is unreadable while it exits) is still waited for and signalled. The
    ``psutil.Process`` objects carry their create time, so a pid reused by an
    unrelated process is never taken for one of the job's.
    """

    def __init__(self, root_pid: int | None, pgid: int | None, tag: str | None) -> None:
        self._where = (root_pid, pgid, tag)
        self.all: set[psutil.Process] = set()

    def scan(self) -> list[psutil.Process]:
        self.all.update(job_processes(*self._where))
        return [proc for proc in self.all if _alive(proc)]

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(proc.pid for proc in self.all)


def _wait_exit(procs: Iterable[psutil.Process], timeout: float) -> None:
    """Block until every one of ``procs`` has exited (gone or a zombie), or ``timeout`` s pass.

    Waits on pidfds, which become readable when their process exits and never
    reap it: the runner and the session reap their own children.
    (``psutil.wait_procs`` would reap them, and on a zombie that is not our
    child it waits out the whole timeout.) Sleeps ``timeout`` s where pidfds
    are not available.
    """
    deadline = time.monotonic() + timeout
    poller = select.poll()
    fds: list[int] = []
    try:
        waiting: set[int] = set()
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                continue  # already reaped
            fds.append(fd)
            if _alive(proc):  # checked after the open, so the pidfd is this process's
                poller.register(fd, select.POLLIN)
                waiting.add(fd)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                waiting.discard(fd)
    except (AttributeError, OSError):  # no pidfd_open (before Linux 5.3), or out of fds
        time.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        for fd in fds:
            os.close(fd)


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

    Returns once every process of the job it ever found has exited (gone or a
    zombie) and a fresh scan finds no other, or after ``bound`` s of KILL
    rounds with the pids that survived (a process stuck in the kernel).
    Pass ``root_pid=None`` once the root has been reaped: its pid may already
    belong to an unrelated process.
    Blocking: the asyncio runner calls it through ``asyncio.to_thread``.
    """
    found = _Found(root_pid, pgid, tag)
    procs = found.scan()
    settle_until = time.monotonic() + settle
    while procs and time.monotonic() < settle_until and not (hurry and hurry.is_set()):
        _wait_exit(procs, min(_POLL, settle_until - time.monotonic()))
        procs = found.scan()
    killed = set(procs)
    if not procs:
        return KillReport(0, (), found.pids)

    def report(survivors: tuple[int, ...] = ()) -> KillReport:
        return KillReport(len(killed), survivors, found.pids)

    _signal_all(procs, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (hurry and hurry.is_set()):
        procs = found.scan()
        killed.update(procs)
        if not procs:
            return report()
        _signal_all(procs, None, signal.SIGTERM)  # newcomers forked during the grace period
        _wait_exit(procs, _POLL)
    deadline = time.monotonic() + bound
    while True:
        procs = found.scan()
        killed.update(procs)
        if not procs:
            return report()
        if time.monotonic() > deadline:
            return report(tuple(sorted(proc.pid for proc in procs)))
        _signal_all(procs, pgid, signal.SIGKILL)
        _wait_exit(procs, _POLL)
