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
from dataclasses import dataclass, field
from typing import Any

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
    # Each process gets one TERM: a second one reaching a process that is exiting
    # after its handler ran (Python restores the default action as it finalises)
    # would end it there, in the middle of what it does on TERM (a coverage save).
    termed = set(procs)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (hurry and hurry.is_set()):
        procs = found.scan()
        killed.update(procs)
        if not procs:
            return report()
        newcomers = [proc for proc in procs if proc not in termed]  # forked during the grace
        _signal_all(newcomers, None, signal.SIGTERM)
        termed.update(newcomers)
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


# ---- CPU use of running jobs -----------------------------------------------------------

# Seconds between two scans of the running jobs' process trees. A scan reads every process on
# the machine (some 25 ms of CPU for 130 processes on a slow core): at 2 s it costs ~1% of one.
CPU_INTERVAL = 2.0
_SETTLED = 1.0  # a process this old has exec'd if it ever will: its environment is final


@dataclass(frozen=True)
class CpuUse:
    """What a job's process tree used: ``seconds`` of CPU over ``wall`` seconds, and ``peak``,
    the most cores it used over one sampling interval."""

    seconds: float
    wall: float
    peak: float

    @property
    def mean(self) -> float:
        """Cores used on average: CPU seconds over wall seconds."""
        return self.seconds / self.wall if self.wall > 0 else 0.0


def _cpu_total(times: Any) -> float:
    # A process's own time and that of the children it has reaped (Linux's cutime/cstime).
    return times.user + times.system + _cpu_reaped(times)


def _cpu_reaped(times: Any) -> float:
    return getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)


_Table = dict[int, tuple[float, int, float, float]]  # pid -> (created, ppid, total, reaped part)


@dataclass
class _Metered:
    """One job the meter watches (see ``CpuMeter``)."""

    root: int
    tag: str | None
    started: float
    baseline: float  # what the root had used before it was watched (an early start)
    # (pid, creation time) -> (ppid, total, the part of total its reaped children make)
    seen: dict[tuple[int, float], tuple[int, float, float]] = field(default_factory=dict)
    gone: float = 0.0  # CPU seconds of processes that ended without a parent of the job
    last: tuple[float, float] | None = None  # (time, total) of the latest sample
    exited: tuple[float, float] | None = None  # (time, the root's exit figure): see ``exited``
    high: float | None = None  # the highest total so far: the peak counts only what is new
    peak: float = 0.0


class CpuMeter:
    """The CPU use of the process trees of running jobs, sampled in one scan for all of them.

    A job's processes are the descendants of its root and every process that
    carries its tag (Ray's workers and daemons leave the tree but keep the
    environment), as for ``kill_job``. Each scan reads every process's CPU
    times once; a job's total is the sum over its live processes (each with
    the children it reaped) plus the last figure of those that ended with no
    parent in the job to reap them. What a process used after the last scan
    before it ended is not counted, unless the runner hands the root's exit
    figure to ``exited`` (a fork server's child: its wait status carries the
    CPU time of the root and every child it reaped), which also measures a
    job shorter than one interval; without either, ``stop`` returns None.

    ``watch``, ``exited`` and ``stop`` are called by the runner on its event
    loop; the scans run in a thread of their own while a job is watched
    (``start``).
    """

    def __init__(
        self, interval: float = CPU_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._jobs: dict[object, _Metered] = {}
        self._tags: dict[tuple[int, float], str | None] = {}  # settled processes' job tags
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a job to watch, or closing
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._cores = float(os.cpu_count() or 1)

    def start(self) -> None:
        """Begin scanning in a daemon thread, every ``interval`` s while a job is watched."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpusched-cpu", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the scanning thread (watched jobs are forgotten)."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def watch(self, key: object, root_pid: int, tag: str | None) -> None:
        """Measure the job ``key`` from now on: the tree under ``root_pid``, and ``tag``'s processes."""
        try:
            baseline = _cpu_total(psutil.Process(root_pid).cpu_times())
        except psutil.Error:
            baseline = 0.0
        with self._lock:
            self._jobs[key] = _Metered(root_pid, tag, self._clock(), baseline)
        self._wake.set()

    def exited(self, key: object, cpu_seconds: float) -> None:
        """The job's root has exited having used ``cpu_seconds``, its own and those of the
        children it reaped (its exit status's resource use): exact where the scans only
        sample, and known even for a job shorter than one scan. The first call counts."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and job.exited is None:
                job.exited = (self._clock(), cpu_seconds)

    def stop(self, key: object) -> CpuUse | None:
        """The job's use from ``watch`` to its last scan, or to its root's exit where that
        figure is the larger; None if neither is known. Forgets it."""
        with self._lock:
            job = self._jobs.pop(key, None)
        if job is None:
            return None
        figures = [known for known in (job.last, job.exited) if known is not None]
        if not figures:
            return None
        # The scans also see processes outside the root's reaped tree (Ray's workers); the
        # exit figure also holds what the tree used after the last scan: take the larger.
        when, total = max(figures, key=lambda figure: figure[1])
        wall = when - job.started
        seconds = min(max(0.0, total - job.baseline), self._cores * wall)
        mean = CpuUse(seconds, wall, 0.0).mean
        return CpuUse(seconds, wall, max(job.peak, mean))  # no interval is below the mean

    def sample(self) -> None:
        """Scan every process once and update every watched job (blocking: the meter's thread)."""
        with self._lock:
            jobs = list(self._jobs.values())
        if not jobs:
            return
        began = self._clock()
        table: _Table = {}
        children: dict[int, list[int]] = {}
        for proc in psutil.process_iter(["ppid", "create_time", "cpu_times"]):
            info = proc.info
            if info["cpu_times"] is None or info["create_time"] is None:
                continue  # gone meanwhile, or not ours to read
            times = info["cpu_times"]
            table[proc.pid] = (
                info["create_time"], info["ppid"], _cpu_total(times), _cpu_reaped(times)
            )  # fmt: skip
            children.setdefault(info["ppid"], []).append(proc.pid)
        now = (began + self._clock()) / 2  # on a loaded machine one scan can take a while
        members = [self._members(job, table, children) for job in jobs]
        tagged = {job.tag: found for job, found in zip(jobs, members, strict=True) if job.tag}
        if tagged:
            claimed = set().union(*members)
            for pid, (created, _ppid, _total, _reaped) in table.items():
                if pid not in claimed:
                    tag = self._tag_of(pid, created, now)
                    if tag in tagged:
                        tagged[tag].add(pid)
        with self._lock:
            for job, found in zip(jobs, members, strict=True):
                _account(job, found, table, now, self._cores)

    def _members(
        self,
        job: _Metered,
        table: _Table,
        children: dict[int, list[int]],
    ) -> set[int]:
        found: set[int] = set()
        if job.root in table and job.root != os.getpid():
            stack = [job.root]
            while stack:
                pid = stack.pop()
                if pid not in found:
                    found.add(pid)
                    stack.extend(children.get(pid, ()))
        return found

    def _tag_of(self, pid: int, created: float, now: float) -> str | None:
        key = (pid, created)
        if key in self._tags:
            return self._tags[key]
        try:
            tag = psutil.Process(pid).environ().get(TAG_VARIABLE)
        except psutil.Error:
            tag = None
        if time.time() - created > _SETTLED:  # a younger one may still exec another environment
            self._tags[key] = tag
        return tag

    def _loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                idle = not self._jobs
            if idle:
                self._wake.wait()
                self._wake.clear()
                continue
            if self._closed.wait(self._interval):
                return
            self.sample()
            if len(self._tags) > 100_000:
                self._tags.clear()  # pids of long-gone processes


def _account(
    job: _Metered,
    found: set[int],
    table: _Table,
    now: float,
    cores: float,
) -> None:
    """Fold one scan's ``found`` processes of ``job`` into its total and peak.

    A process that ended counts through the parent that reaped it (its time is
    in the parent's reaped children's time), or, with no parent in the job,
    by its last figure. A parent that never waits for its children (Ray's
    raylet ignores SIGCHLD, so the kernel reaps its workers) gains nothing
    when they end: what the parent's reaped time fell short of its ended
    children's last figures is added too.

    A scan reads one process after another: a child read just before it ends
    and its parent read just after reaping it count it twice in that scan,
    and a child gone before its parent reaped it counts in neither. The
    total is right again at the next scan, so the peak measures only what
    rises above the highest total seen, and no more than the machine's cores.
    (Where the child was read first, its parent's reaped time had already
    grown when the child is missed, so the child counts twice for good: an
    over- rather than an underestimate, and rare: a scan reads in pid order.)
    """
    current = {(pid, table[pid][0]): (table[pid][1], table[pid][2], table[pid][3]) for pid in found}
    alive = {key[0]: key for key in current}  # pid -> (pid, creation time)
    ended_children: dict[int, float] = {}  # a live parent's pid -> its ended children's figures
    for key, (ppid, total, _reaped) in job.seen.items():
        if key in current:
            continue
        if ppid in alive:
            ended_children[ppid] = ended_children.get(ppid, 0.0) + total
        else:
            job.gone += total  # no parent of the job reaped it: its time is nowhere else
    for ppid, expected in ended_children.items():
        parent = alive[ppid]
        before = job.seen[parent][2] if parent in job.seen else 0.0
        job.gone += max(0.0, expected - (current[parent][2] - before))
    job.seen = current
    total = job.gone + sum(cpu for _ppid, cpu, _reaped in current.values())
    since, before = job.last if job.last is not None else (job.started, job.baseline)
    high = before if job.high is None else job.high
    if now > since and total > high:
        job.peak = min(cores, max(job.peak, (total - high) / (now - since)))
    job.high = max(high, total)
    job.last = (now, total)
