"""The asyncio runner: applies the policy's decisions by starting and killing real processes.

One task per running file; the main loop consumes one queue of typed events
(``Started``, ``Finished``, ``Interrupt``) and asks the policy what to start
next. Timeouts, crashes, leftover processes and interrupts are handled here;
the policy only hears "this job is done, these cards are free".
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from gpusched.coverage.data import coverage_env
from gpusched.execution.childenv import PortPool, card_env, child_env, plugin_args
from gpusched.execution.forkclient import ForkedProcess, ForkServer, ServerGone
from gpusched.execution.proctree import CpuMeter, KillReport, kill_job
from gpusched.execution.warmstart import GATE_VARIABLE, Gate, prestart_env
from gpusched.requirements import Requirement
from gpusched.results import (
    DEFERRED,
    EXIT_RECOLLECTED,
    FAILING,
    FileResult,
    Outcome,
    Recollected,
    TestResult,
    judge,
    parse_expectation,
    read_recollection,
)
from gpusched.scheduling import Assignment, Job, Policy, Unschedulable

T = TypeVar("T")
SETTLE = 0.5  # after pytest exits, seconds its helpers get to end by themselves


@dataclass(frozen=True)
class RunConfig:
    """How to run each file; built once by the session from the resolved options."""

    pytest_args: tuple[str, ...]
    timeout: float | None
    kill_grace: float
    simulated: bool
    log_dir: Path
    work_dir: Path  # streams of the children; the session removes it
    tmp_root: str  # per-job RAY_TMPDIR parent, on local disk
    run_id: str
    reruns: int = 0
    exitfirst: bool = False
    rootdir: str = "."
    heartbeat: float | None = None  # seconds between "still running" lines; None: none
    prestart: int = (
        0  # GPU files started ahead of their cards (gpusched.execution.warmstart); 0: off
    )
    coverage: Path | None = None  # a measuring run: each attempt's data goes in a folder here


@dataclass(frozen=True)
class Started:
    job: Job
    cards: tuple[str, ...]
    pid: int
    attempt: int


@dataclass(frozen=True)
class Finished:
    """A job is over: no process of it is left and its cards were checked (``quarantined``)."""

    job: Job
    result: FileResult
    pids: frozenset[int] = frozenset()
    quarantined: tuple[str, ...] = ()
    requeue: Recollected | None = None  # it stopped before its tests: needs other cards
    deselected: bool = False  # a deferred file whose own collection selected no test


@dataclass(frozen=True)
class Interrupt:
    signum: int


@dataclass(frozen=True)
class Ready:
    """A child reached its gate: its start-up no longer competes for the cores."""

    job_id: int


@dataclass(frozen=True)
class Tick:
    """Time for a heartbeat line (``--heartbeat``)."""


@dataclass(frozen=True)
class Wake:
    """New jobs were submitted, or the input closed: look at the policy again."""


Event = Started | Finished | Interrupt | Ready | Tick | Wake


@dataclass
class Child:
    """One attempt's pytest process and what must be cleaned up after it."""

    proc: asyncio.subprocess.Process | ForkedProcess
    tag: str
    stream: Path
    log_path: Path
    ray_tmpdir: str
    gate: Gate | None = None  # with warm starts on (cold children's gate opens at once)
    warm: bool = False  # waiting for its cards behind a closed gate
    watcher: asyncio.Task | None = None  # posts Ready once the child reached its gate
    started: float | None = None  # monotonic; set for an early start (begun before the runner)
    # Its coverage folder in a measuring run (removed with an early start that is dropped).
    coverage: Path | None = None

    def close_gate(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if self.gate is not None:
            self.gate.close()


class Reporter(Protocol):
    """Who hears about progress (console, live view); called from the runner's loop only."""

    def started(self, job: Job, cards: tuple[str, ...], attempt: int) -> None: ...

    def finished(self, result: FileResult) -> None: ...

    def interrupting(self, signum: int, second: bool) -> None: ...

    def deselected(self, job: Job) -> None:
        """A started file turned out to select no test (its own collection): it has no result."""
        ...

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        """Still running: each file with its elapsed seconds (only with ``--heartbeat``)."""
        ...


class CardReleaser(Protocol):
    """Decides when a job's cards may be handed out again (NVML on real cards)."""

    async def release(self, cards: tuple[str, ...], pids: frozenset[int]) -> list[str]:
        """Wait until the cards are free; return the ids that never came back (quarantined)."""
        ...


class ImmediateRelease:
    """Simulated cards hold no memory: they are free as soon as the job's processes are gone."""

    async def release(self, cards: tuple[str, ...], pids: frozenset[int]) -> list[str]:
        return []


@dataclass
class RunReport:
    """What the runner produced, for the reports."""

    results: list[FileResult] = field(default_factory=list)
    interrupted: bool = False
    quarantined: list[str] = field(default_factory=list)


def log_name(path: str, rootdir: str) -> str:
    try:
        relative = os.path.relpath(path, rootdir)
    except ValueError:
        relative = path
    return re.sub(r"[^A-Za-z0-9._-]+", "_", relative).strip("_") + ".log"


@dataclass(frozen=True)
class _Launch:
    """What one attempt's child is started with: its tag, files, environment and arguments."""

    tag: str
    stream: Path
    log_path: Path
    ray_tmpdir: str
    env: dict[str, str]
    args: list[str]
    coverage: Path | None = None


def _launch(
    config: RunConfig,
    path: str,
    key: str,
    cards: tuple[str, ...],
    port: int,
    expect: str | None = None,
) -> _Launch:
    """Name the attempt's files and build its environment (creates its ``RAY_TMPDIR``).

    ``expect`` is the collection cache's prediction for the file, which its child checks.
    """
    tag = f"{config.run_id}-{key}"
    stream = config.work_dir / f"{key}.jsonl"
    ray_tmpdir = tempfile.mkdtemp(prefix="gs", dir=config.tmp_root)
    env = child_env(
        os.environ,
        cards,
        simulated=config.simulated,
        ray_tmpdir=ray_tmpdir,
        master_port=port,
        tag=tag,
    )
    coverage = config.coverage / key if config.coverage is not None else None
    if coverage is not None:
        env.update(coverage_env(coverage))
    args = [path, *plugin_args(), f"--gpusched-results={stream}", *config.pytest_args]
    if expect is not None:
        args.append(f"--gpusched-expect={expect}")
    log_path = config.log_dir / log_name(path, config.rootdir)
    return _Launch(tag, stream, log_path, ray_tmpdir, env, args, coverage)


def start_early(
    server: ForkServer, config: RunConfig, ports: PortPool, path: str, key: str
) -> Child | None:
    """Fork a CPU file before collection is done (``gpusched.scheduling.earlystart``); None if the server is gone.

    Blocking: called by the session before the event loop runs. The runner
    adopts the child (``Runner.adopt``) or the session stops it. It started
    before collection said anything of its file, so it reports what its own
    collection found (``DEFERRED``), and never stops for it: early starts
    happen only where there is no card to wait for.
    """
    launch = _launch(config, path, key, (), ports.take(), DEFERRED)
    try:
        pid = server.spawn(launch.args, launch.env, launch.log_path, launch.tag)
    except ServerGone:
        shutil.rmtree(launch.ray_tmpdir, ignore_errors=True)
        return None
    proc = ForkedProcess(server, pid)
    child = Child(proc, launch.tag, launch.stream, launch.log_path, launch.ray_tmpdir)
    child.started = time.monotonic()
    child.coverage = launch.coverage
    return child


def stop_early(child: Child, server: ForkServer) -> None:
    """Kill an early child whose file was not collected, and forget everything it wrote."""
    pid = child.proc.pid
    kill_job(pid if child.proc.returncode is None else None, pid, child.tag, grace=1.0)
    server.wait(pid, 5.0)
    shutil.rmtree(child.ray_tmpdir, ignore_errors=True)
    child.stream.unlink(missing_ok=True)
    child.log_path.unlink(missing_ok=True)
    if child.coverage is not None:
        shutil.rmtree(child.coverage, ignore_errors=True)


class RevisesPending:
    """``revise`` for a run whose policy can withdraw a pending job (the local and cluster runs).

    The class using it has ``policy.withdraw``, ``submit`` and the ``expect``
    predictions by path.
    """

    def revise(self, job: Job, tests: Sequence[str], expect: str | None) -> bool:
        """Replace a pending job (its requirement, tests, prediction); False if it already started."""
        if self.policy.withdraw(job.id) is None:
            return False
        self.submit([job], {job.path: tests}, {job.path: expect} if expect else None)
        if expect is None:
            self.expect.pop(job.path, None)
        return True


class Runner(RevisesPending):
    """Runs jobs until none is pending or running, or until interrupted."""

    def __init__(
        self,
        config: RunConfig,
        policy: Policy,
        tests: Mapping[str, Sequence[str]],
        reporter: Reporter,
        releaser: CardReleaser | None = None,
        clock: Callable[[], float] = time.monotonic,
        forkserver: ForkServer | None = None,
        t0: float | None = None,
        expect: Mapping[str, str] | None = None,
        refit: Callable[[Requirement, tuple[Requirement, ...]], Requirement] | None = None,
        open_input: bool = False,
        requeue: Callable[[Job, Recollected], None] | None = None,
    ) -> None:
        """``expect``: the collection cache's prediction for each file it described; ``refit``
        lowers a requirement a child found instead to what the inventory can run.

        ``requeue``: who places a file again whose child found it needs other cards
        than predicted (a node agent hands it back to the driver); by default this
        runner's own policy, with the requirement ``refit`` gives.

        ``open_input``: more jobs may come while it runs (``submit``), until
        ``close_input``; ``run`` does not end before that unless it is stopping.
        """
        self.config = config
        self.policy = policy
        self.tests = dict(tests)
        self.input_open = open_input
        self.expect = dict(expect or {})
        self.refit = refit or (lambda requirement, levels: requirement)
        self.requeue = requeue
        self.recollected: set[str] = set()  # files whose child found the cache wrong
        self.found: dict[str, Recollected] = {}  # deferred files: what their child collected
        self.reporter = reporter
        self.releaser = releaser or ImmediateRelease()
        self.clock = clock
        self.t0 = clock() if t0 is None else t0  # earlier when files started before the runner
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.tasks: dict[int, asyncio.Task] = {}
        self.attempts: dict[int, int] = {}
        self.first_failures: dict[int, FileResult] = {}
        self.hurry = threading.Event()
        self.ports = PortPool()
        self.report = RunReport()
        self.stopping = False
        self.stop_reason = "-x"  # why pending files did not start, once stopping
        self.running: dict[int, tuple[Job, float]] = {}  # job id -> (job, start on self.clock)
        self.warm: dict[int, asyncio.Task[Child]] = {}  # job id -> its pre-started child
        self.starting: set[int] = set()  # jobs whose child has not reached its gate yet
        self._cores = os.cpu_count() or 1
        self.meter = CpuMeter()  # each file's process tree: its CPU use goes into its result
        self._tick_pending = False
        self.forkserver = forkserver
        self.forkserver_lost: str | None = None  # why files went back to fresh processes mid-run
        self._prestart = config.prestart
        if any("no:gpusched" in arg for arg in config.pytest_args):
            self._prestart = 0  # the gate lives in the plugin
        if forkserver is not None:
            self._prestart = 0  # a forked child starts in milliseconds: nothing to hide

    async def run(self, jobs: Sequence[Job]) -> RunReport:
        """Run ``jobs``, and those ``submit`` adds while ``open_input``."""
        loop = asyncio.get_running_loop()
        self.policy.submit(jobs)
        installed = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, self._on_signal, signum)
                installed.append(signum)
            except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
                pass
        beat = asyncio.create_task(self._beat()) if self.config.heartbeat else None
        attached = self.forkserver
        if attached is not None and attached.attached:
            attached = None  # the caller attached it (collection streams beside the runner)
        if attached is not None:
            attached.attach()
        self.meter.start()
        try:
            await self._loop()
        except (asyncio.CancelledError, KeyboardInterrupt):
            # Cancelled from outside (asyncio.run's own Ctrl-C handling, an embedding
            # caller) or a KeyboardInterrupt that slipped past the handlers: same as Ctrl-C.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._interrupt(signal.SIGINT)
            await self._drain()
        finally:
            if beat is not None:
                beat.cancel()
            await _finish_anyway(self._cool_down())
            self.meter.close()
            if attached is not None:
                attached.detach()
            for signum in installed:
                loop.remove_signal_handler(signum)
        for job in self.policy.cancel_pending():
            self._record(
                FileResult(
                    job.path,
                    Outcome.NOT_RUN,
                    tests=[_not_run(nodeid) for nodeid in self.tests.get(job.path, ())],
                    message="not started (interrupted)"
                    if self.report.interrupted
                    else f"not started ({self.stop_reason})",
                )
            )
        return self.report

    def submit(
        self,
        jobs: Sequence[Job],
        tests: Mapping[str, Sequence[str]] | None = None,
        expect: Mapping[str, str] | None = None,
    ) -> None:
        """Add jobs while running (``open_input``); call on the runner's event loop.

        ``tests`` and ``expect`` are the new files' test ids and cache predictions.
        """
        self.tests.update(tests or {})
        self.expect.update(expect or {})
        self.policy.submit(jobs)
        self.events.put_nowait(Wake())

    def adopt(self, job: Job, child: Child, tests: Sequence[str] = ()) -> None:
        """Take over ``child``, an early start of ``job``'s file, on the slot the policy reserved.

        Call on the runner's event loop; the child's timeout counts from its own start.
        """
        self.tests[job.path] = tuple(tests)
        self.expect[job.path] = DEFERRED  # as it was started (``start_early``)
        self.policy.adopt(job)
        self.attempts[job.id] = 1
        running: asyncio.Future[Child] = asyncio.get_running_loop().create_future()
        running.set_result(child)
        self.tasks[job.id] = asyncio.create_task(self._run_job(job, (), 1, running))  # type: ignore[arg-type]

    def release_reserved(self) -> None:
        """A reserved CPU slot is free again (an early start not adopted, the collection done)."""
        self.policy.release_cpu(1)
        self.events.put_nowait(Wake())

    def stop(self, reason: str) -> None:
        """Start no new file; the running ones finish, the pending ones are NOT RUN (``reason``)."""
        self.stopping = True
        self.stop_reason = reason
        self.events.put_nowait(Wake())

    def close_input(self) -> None:
        """No more jobs will be submitted: ``run`` ends once the last one is done."""
        self.input_open = False
        self.events.put_nowait(Wake())

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        """As if the user pressed Ctrl-C (``signum``): running files are killed, pending are NOT RUN."""
        self.events.put_nowait(Interrupt(signum))

    def _on_signal(self, signum: int) -> None:
        self.interrupt(signum)

    async def _beat(self) -> None:
        """Queue a ``Tick`` every ``heartbeat`` seconds, on a fixed grid from the start.

        A tick is not queued while the previous one is unhandled, so a busy loop
        never prints a burst of identical lines when it catches up.
        """
        interval = self.config.heartbeat
        assert interval is not None
        while True:
            elapsed = self.clock() - self.t0
            await asyncio.sleep(interval - elapsed % interval)
            if not self._tick_pending:
                self._tick_pending = True
                self.events.put_nowait(Tick())

    def _heartbeat(self) -> None:
        self._tick_pending = False
        if self.running:
            now = self.clock()
            self.reporter.heartbeat(
                [(job, now - since) for job, since in sorted(self.running.values(), key=_by_start)]
            )

    async def _loop(self) -> None:
        while True:
            if not self.stopping:
                self._start_what_fits()
                self._warm_up()
            if not self.tasks and (
                self.stopping or not (self.input_open or self.policy.has_pending)
            ):
                return
            event = await self.events.get()
            match event:
                case Ready(job_id):
                    self.starting.discard(job_id)
                case Started(job, cards, _pid, attempt):
                    self.running[job.id] = (job, self.clock())
                    self.reporter.started(job, cards, attempt)
                case Finished(job, result, _pids, quarantined, requeue, deselected):
                    self.running.pop(job.id, None)
                    self._finished(job, result, quarantined, requeue, deselected)
                case Interrupt(signum):
                    self._interrupt(signum)
                case Tick():
                    self._heartbeat()
                case Wake():
                    pass

    def _interrupt(self, signum: int) -> None:
        second = self.report.interrupted
        self.reporter.interrupting(signum, second)
        if second:
            self.hurry.set()  # a second Ctrl-C: no grace period for anyone
        self.report.interrupted = True
        self.stopping = True
        if second:
            return  # the tasks are already killing their jobs; cancelling again would lose them
        for task in self.tasks.values():
            task.cancel()

    async def _drain(self) -> None:
        """After an outside cancellation: collect the killed jobs' results."""
        while self.tasks:
            match await self.events.get():
                case Finished(job, result, _pids, quarantined):
                    self.tasks.pop(job.id, None)
                    self.running.pop(job.id, None)
                    self.report.quarantined.extend(quarantined)
                    self.policy.complete(job.id, quarantined)
                    self._record(result)
                case Interrupt(signum):
                    self._interrupt(signum)
                case _:
                    pass

    def _start_what_fits(self) -> None:
        for decision in self.policy.schedule():
            match decision:
                case Assignment(job, cards):
                    attempt = self.attempts.get(job.id, 0) + 1
                    self.attempts[job.id] = attempt
                    card_ids = tuple(card.id for card in cards)
                    warm = self.warm.pop(job.id, None)
                    if warm is None and self._prestart:
                        self.starting.add(job.id)  # its gate opens at once; it starts cold
                    self.tasks[job.id] = asyncio.create_task(
                        self._run_job(job, card_ids, attempt, warm)
                    )
                case Unschedulable(job, reason):
                    self._record(
                        FileResult(
                            job.path,
                            Outcome.SKIPPED,
                            message=reason,
                            tests=[
                                _skipped(nodeid, reason) for nodeid in self.tests.get(job.path, ())
                            ],
                        )
                    )

    def _finished(
        self,
        job: Job,
        result: FileResult,
        quarantined: tuple[str, ...],
        requeue: Recollected | None = None,
        deselected: bool = False,
    ) -> None:
        self.tasks.pop(job.id, None)
        self.report.quarantined.extend(quarantined)
        self.policy.complete(job.id, quarantined)
        if deselected:
            self.reporter.deselected(job)  # pytest lists no file whose tests are all deselected
            if result.log:
                Path(result.log).unlink(missing_ok=True)
            return
        if requeue is not None:
            if self.stopping:
                self._record(
                    FileResult(
                        job.path,
                        Outcome.NOT_RUN,
                        tests=[_not_run(nodeid) for nodeid in requeue.tests],
                        message="not started (stopping)",
                    )
                )
                return
            self.attempts[job.id] -= 1  # it ran no test: not an attempt
            self.expect.pop(job.path, None)  # from now on the child's own collection is the truth
            if self.requeue is not None:
                self.requeue(job, requeue)
                return
            requirement = self.refit(requeue.requirement, requeue.levels)
            self.policy.submit([dataclasses.replace(job, requirement=requirement)])
            return
        attempt = self.attempts[job.id]
        if result.outcome in FAILING and attempt <= self.config.reruns and not self.stopping:
            self.first_failures.setdefault(job.id, result)
            self.reporter.finished(result)
            self.policy.submit([job])
            return
        if job.id in self.first_failures:
            first = self.first_failures.pop(job.id)
            result.attempts = attempt
            if result.outcome == Outcome.PASSED:
                result.outcome = Outcome.FLAKY
                result.message = f"passed on attempt {attempt} after {first.outcome.lower()}"
        self._record(result)
        if self.config.exitfirst and result.outcome in FAILING:
            self.stopping = True

    def _record(self, result: FileResult) -> None:
        self.report.results.append(result)
        self.reporter.finished(result)

    def _warm_up(self) -> None:
        """Pre-start the GPU jobs likely to start next, up to ``prestart`` waiting at once.

        Only on idle cores: while as many children as there are cores are still
        starting up, a warm start would slow down files that hold their cards.
        """
        if not self._prestart:
            return
        for job in self.policy.upcoming(self._prestart):
            if len(self.warm) >= self._prestart or len(self.starting) >= self._cores:
                break
            if job.id not in self.warm:
                attempt = self.attempts.get(job.id, 0) + 1
                self.starting.add(job.id)
                self.warm[job.id] = asyncio.create_task(self._spawn(job, attempt, None))

    async def _cool_down(self) -> None:
        """Stop the pre-started children whose files will not run (end of run, ``-x``, Ctrl-C)."""
        warm, self.warm = list(self.warm.values()), {}
        for task in warm:
            try:
                child = await task
            except Exception:  # noqa: BLE001 - it never started: nothing to stop
                continue
            if child.gate is not None:
                child.gate.cancel()  # end of file: the child exits by itself
            root = child.proc.pid if child.proc.returncode is None else None
            await asyncio.to_thread(kill_job, root, child.proc.pid, child.tag, 1.0, self.hurry)
            await child.proc.wait()
            child.close_gate()
            shutil.rmtree(child.ray_tmpdir, ignore_errors=True)
            child.log_path.unlink(missing_ok=True)

    async def _spawn(self, job: Job, attempt: int, cards: tuple[str, ...] | None) -> Child:
        """Start ``job``'s pytest process on ``cards``, or warm (``None``) behind a closed gate."""
        launch = _launch(
            self.config,
            job.path,
            f"{job.id}-{attempt}",
            cards or (),
            self.ports.take(),
            self.expect.get(job.path),
        )
        tag, stream, log_path = launch.tag, launch.stream, launch.log_path
        ray_tmpdir, env, args = launch.ray_tmpdir, launch.env, launch.args
        if self.forkserver is not None and cards is not None:
            try:
                forked = await self.forkserver.start(args, env, log_path, tag)
            except ServerGone as exc:
                self.forkserver_lost = str(exc)
                self.forkserver = None  # this file and the next ones start fresh processes
            except BaseException:
                shutil.rmtree(ray_tmpdir, ignore_errors=True)
                raise
            else:
                return Child(forked, tag, stream, log_path, ray_tmpdir)
        command = [sys.executable, "-m", "pytest", *args]
        gate = Gate() if self._prestart else None
        if gate is not None and cards is None:
            env = prestart_env(env, card_env(()), gate.child_fd)
        elif gate is not None:
            env[GATE_VARIABLE] = str(gate.child_fd)
        try:
            with open(log_path, "wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    *command,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    env=env,
                    process_group=0,
                    pass_fds=() if gate is None else (gate.child_fd,),
                )
        except BaseException:
            shutil.rmtree(ray_tmpdir, ignore_errors=True)
            self.starting.discard(job.id)
            if gate is not None:
                gate.close()
            raise
        child = Child(proc, tag, stream, log_path, ray_tmpdir, gate, warm=cards is None)
        if gate is not None:
            gate.spawned()
            if cards is not None:
                gate.open(card_env(cards))
            child.watcher = asyncio.create_task(self._watch_start(job.id, gate))
        return child

    async def _watch_start(self, job_id: int, gate: Gate) -> None:
        try:
            await gate.ready()
        finally:
            self.events.put_nowait(Ready(job_id))

    def _exited(self, job: Job, proc: asyncio.subprocess.Process | ForkedProcess) -> None:
        """Hand the meter the root's exit figure, where the fork server reported one."""
        cpu = proc.exit_cpu if isinstance(proc, ForkedProcess) else None
        if cpu is not None:
            self.meter.exited(job.id, cpu)

    async def _run_job(
        self,
        job: Job,
        cards: tuple[str, ...],
        attempt: int,
        warm: asyncio.Task[Child] | None = None,
    ) -> None:
        config = self.config
        start = self.clock() - self.t0
        timed_out: float | None = None
        interrupted = False
        child: Child | None = None
        kill = KillReport(0, ())
        # A started process must be known even if we are cancelled while it starts.
        spawning = warm or asyncio.ensure_future(self._spawn(job, attempt, cards))
        try:
            child = await asyncio.shield(spawning)
            timeout = config.timeout
            if child.started is not None:  # an early start: it has been running since then
                start = child.started - self.t0
                if timeout is not None:
                    timeout = max(0.0, timeout - (self.clock() - child.started))
            if child.warm:
                start = self.clock() - self.t0
                child.warm = False
                assert child.gate is not None
                child.gate.open(card_env(cards))  # False: it already ended; its log says why
            proc = child.proc
            self.meter.watch(job.id, proc.pid, child.tag)
            self.events.put_nowait(Started(job, cards, proc.pid, attempt))
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                self._exited(job, proc)
            except TimeoutError:
                timed_out = config.timeout
            root = proc.pid if proc.returncode is None else None  # a reaped pid may be reused
            kill = await asyncio.to_thread(
                kill_job,
                root,
                proc.pid,
                child.tag,
                config.kill_grace,
                self.hurry,
                settle=SETTLE if timed_out is None else 0.0,
            )
            await proc.wait()
            self._exited(job, proc)
        except asyncio.CancelledError:
            interrupted = True
            if child is None:
                child = await _finish_anyway(spawning)
            if child.warm and child.gate is not None:
                child.gate.cancel()  # end of file: a waiting child exits by itself
            proc = child.proc
            root = proc.pid if proc.returncode is None else None
            kill = await _finish_anyway(
                asyncio.to_thread(
                    kill_job, root, proc.pid, child.tag, config.kill_grace, self.hurry
                )
            )
            await _finish_anyway(proc.wait())
        finally:
            if child is not None:
                child.close_gate()
                shutil.rmtree(child.ray_tmpdir, ignore_errors=True)
        pids: set[int] = set()
        lines: list[str] = []
        if child is not None:
            pids.add(child.proc.pid)
            pids.update(kill.pids)
            try:
                lines = child.stream.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                pass
        returncode = child.proc.returncode if child is not None else None
        requeue = self._recollected(job, lines, returncode, timed_out is None and not interrupted)
        if requeue is not None and child is not None:
            child.stream.unlink(missing_ok=True)  # the next attempt reuses its name
        result = judge(
            job.path,
            self.tests.get(job.path, ()),
            returncode if returncode is not None else -1,
            lines,
            timed_out=timed_out,
            interrupted=interrupted,
        )
        log_path = (
            child.log_path
            if child is not None
            else config.log_dir / log_name(job.path, config.rootdir)
        )
        result.cards, result.start, result.end = cards, start, self.clock() - self.t0
        use = self.meter.stop(job.id)  # the tree is gone: its last scan is its whole use
        if use is not None:
            result.cpu, result.cpu_peak = use.mean, use.peak
        result.log, result.attempts = str(log_path), attempt
        if child is not None:
            if timed_out is None and not interrupted:
                result.swept = kill.found  # left behind by tests after pytest itself exited
            if kill.survivors:
                result.message += f" ({len(kill.survivors)} process(es) could not be killed)"
        quarantined: tuple[str, ...] = ()
        if child is not None and kill.survivors:
            quarantined = cards  # a process of the job may still hold them
        elif child is not None and cards and not interrupted:
            try:
                quarantined = tuple(await self.releaser.release(cards, frozenset(pids)))
            except asyncio.CancelledError:
                pass  # interrupted while waiting for the cards: the run is ending anyway
        if quarantined:
            result.message += f" (card(s) {','.join(quarantined)} quarantined)"
        found = self.found.get(job.path)
        deselected = found is not None and not found.tests and result.outcome == Outcome.PASSED
        self.events.put_nowait(
            Finished(job, result, frozenset(pids), quarantined, requeue, deselected)
        )

    def _recollected(
        self, job: Job, lines: Sequence[str], returncode: int | None, ended: bool
    ) -> Recollected | None:
        """Take in what the child found where the cache predicted otherwise; the requeue, if one.

        Its test list replaces the cached one; a different requirement, with the
        child stopped for it before its tests, means the file runs again. A
        deferred file's child always reports what it found and never stops.
        """
        expect = self.expect.get(job.path)
        found = None if expect is None else read_recollection(lines)
        if found is None or expect is None:
            return None
        self.tests[job.path] = found.tests
        if expect == DEFERRED:
            self.found[job.path] = found  # its only collection: the next run's cache entry
            return None
        self.recollected.add(job.path)
        if not ended or returncode != EXIT_RECOLLECTED:
            return None
        return found if found.requirement != parse_expectation(expect)[0] else None


async def _finish_anyway(awaitable: Awaitable[T]) -> T:
    """Await to the end even if cancelled again: a kill that is under way must complete."""
    future = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                return future.result()


def _by_start(running: tuple[Job, float]) -> tuple[float, int]:
    return running[1], running[0].id


def _not_run(nodeid: str) -> TestResult:
    return TestResult(nodeid, "not run")


def _skipped(nodeid: str, reason: str) -> TestResult:
    return TestResult(nodeid, "skipped", 0.0, reason)
