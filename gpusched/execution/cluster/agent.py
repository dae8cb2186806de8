"""The node agent: one per node, a Ray actor that runs the files the driver placed on its node.

It decides nothing. It hosts the local asyncio runner (``Runner(open_input=True)``)
with a ``PinnedPolicy``, so each file it is sent starts on exactly the
node-local cards the driver chose, and gets every guarantee of a run on one
machine: its own process group, ``CUDA_VISIBLE_DEVICES`` of this node's ids,
the job tag and escapee sweep, the per-file timeout that kills the tree, the
NVML release check (quarantine) on real cards, the fork server for warm
children. What the runner reports (started, finished, notes) is queued as
plain event records; the driver fetches them with ``poll``, a long poll that
also serves as the heartbeat.

The class is plain Python: the driver makes it an actor with ``ray.remote``
and pins it to its node. Every method is called by the driver through Ray.

Cards: real ones through NVML, as ``gpusched run`` sees them on one machine
(restricted by the ``CUDA_VISIBLE_DEVICES`` its raylet was started with), or
simulated ones that the node declares with ``GPUSCHED_SIMULATE_GPUS`` in the
environment of its ``ray start`` (same syntax as ``--simulate-gpus``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusched.coverage.data import pack
from gpusched.execution.childenv import RAY_WORKER_NICENESS, local_tmp_root, read_mounts
from gpusched.execution.cluster import versions, watchdog
from gpusched.execution.forkclient import ForkServer, ServerSpec, start_server
from gpusched.execution.preload import auto_preload, fork_unavailable
from gpusched.execution.release import release_check
from gpusched.execution.runner import RunConfig, Runner
from gpusched.inventory import Card, discover, parse_simulate_spec
from gpusched.requirements import Requirement
from gpusched.results import FileResult, Recollected
from gpusched.scheduling.cluster import PinnedPolicy
from gpusched.scheduling.packing import Job

SIMULATE_VARIABLE = (
    "GPUSCHED_SIMULATE_GPUS"  # a node's simulated cards, in its raylet's environment
)
LOG_LIMIT = 1 << 20  # bytes of each file's log sent back to the driver (its end)
POLL_WAIT = 1.0  # seconds a poll waits for events before it answers empty (the heartbeat)
# The agent's actor options: it and the files it forks run at the node's own niceness, as a
# job's driver does under Ray's job supervisor, not at the 15 Ray gives its workers (a Ray
# worker adds RAY_worker_niceness to its niceness at start). Ray merges this into the job's
# runtime env, so the shipped working_dir stays. (Each file's environment has the variable
# at 0 from ``child_env`` in any case, for the Ray workers the file starts itself.)
AGENT_RUNTIME_ENV = {"env_vars": {RAY_WORKER_NICENESS: "0"}}
# Set by Ray in its worker processes; a child pytest must not think it is a Ray worker.
_RAY_WORKER_VARIABLES = ("RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_NODE_ID", "RAY_ADDRESS")


@dataclass(frozen=True)
class NodeInfo:
    """What an agent tells the driver about its node before the run."""

    node_id: str
    hostname: str
    cards: tuple[Card, ...]
    simulated: bool
    cpus: int
    versions: dict[str, str]
    pid: int
    error: str | None = None  # the node cannot take part (a bad GPUSCHED_SIMULATE_GPUS)
    held: int = 0  # GPUs of the node in Ray's accounting that this agent holds for the run
    taken: int = 0  # GPUs of the node in Ray's accounting that other Ray work held at the start


@dataclass(frozen=True)
class AgentConfig:
    """How the agent runs its files; the same for every node, built by the driver from the options."""

    run_id: str  # this node's part of the run: prefixes its job tags
    t0: float  # the driver's start of the run (wall clock): every node's times count from it
    pytest_args: tuple[str, ...]
    timeout: float | None
    kill_grace: float
    reruns: int
    code_root: str | None  # the suite's root directory on this node; None: Ray's working_dir
    fork_server: bool
    preload: tuple[str, ...]
    server_timeout: float
    gpu_release_timeout: float
    gpu_release_memory: int
    coverage: bool = False  # a measuring run: each attempt's data goes back with its result


@dataclass(frozen=True)
class Placed:
    """A file the driver placed on this node: its path under the code root, and its cards."""

    job_id: int
    path: str
    requirement: Requirement
    expected: float
    cards: tuple[str, ...]
    tests: tuple[str, ...]
    expect: str | None = None  # the collection cache's prediction, which the child checks


@dataclass(frozen=True)
class FileStarted:
    job_id: int
    cards: tuple[str, ...]
    attempt: int


@dataclass(frozen=True)
class FileFinished:
    """An attempt ended. ``final``: the file is done (else it runs again: ``--reruns``)."""

    job_id: int
    result: FileResult
    final: bool
    quarantined: tuple[str, ...]
    log: str | None  # the end of its log, for the driver's copy
    recollected: bool = False  # its child found the file other than the cache predicted
    coverage: dict[str, bytes] | None = None  # a measuring run: the attempt's coverage folder


@dataclass(frozen=True)
class FileRequeued:
    """The file's child found it needs other cards than predicted and ran no test: the driver
    places it again. Its cards here are free (checked as after any file)."""

    job_id: int
    requirement: Requirement
    levels: tuple[Requirement, ...]
    tests: tuple[str, ...]
    quarantined: tuple[str, ...] = ()


@dataclass(frozen=True)
class Note:
    """A line for the driver's console (fork server notes, quarantine warnings)."""

    text: str


@dataclass(frozen=True)
class AgentDone:
    """The agent's runner returned: every file it was given has its final result."""

    interrupted: bool


AgentEvent = FileStarted | FileFinished | FileRequeued | Note | AgentDone


def node_cards() -> tuple[list[Card], bool]:
    """This node's cards and whether they are simulated. Raises InventoryError on a bad spec."""
    spec = os.environ.get(SIMULATE_VARIABLE)
    if spec:
        return parse_simulate_spec(spec), True
    return discover(None, None), False


def held_cards(cards: Sequence[Card], simulated: bool, granted: Sequence[str]) -> list[Card]:
    """The node's cards this run may use when Ray counts GPUs there: the ones it gave the agent.

    ``granted`` are the GPU ids Ray gave the agent's actor. Simulated cards are
    matched by id; real ones were already read through the
    ``CUDA_VISIBLE_DEVICES`` Ray set for the actor, unless it was given none
    (then Ray leaves the variable as it was, and no card is the run's).
    """
    if simulated:
        wanted = set(granted)
        return [card for card in cards if card.id in wanted]
    return list(cards) if granted else []


def child_base_env(environ: dict[str, str]) -> dict[str, str]:
    """The agent's environment without what marks a Ray worker (its children are not ones)."""
    return {k: v for k, v in environ.items() if k not in _RAY_WORKER_VARIABLES}


class _Reporter:
    """The runner's ``Reporter`` on an agent: turns its calls into events for the driver."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def started(self, job: Job, cards: tuple[str, ...], attempt: int) -> None:
        self.agent.emit(FileStarted(job.id, cards, attempt))

    def finished(self, result: FileResult) -> None:
        self.agent.finished(result)

    def interrupting(self, signum: int, second: bool) -> None:
        pass  # the driver said it first

    def deselected(self, job: Job) -> None:
        pass  # never called: the driver collects every file before it places it

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        pass

    def say(self, line: str) -> None:
        self.agent.emit(Note(line))


class NodeAgent:
    """Runs the files placed on its node; see the module docstring. One per node and run."""

    def __init__(self) -> None:
        self._events: list[AgentEvent] = []
        self._wakeup: asyncio.Event | None = None
        self._runner: Runner | None = None
        self._policy = PinnedPolicy()
        self._run_task: asyncio.Task | None = None
        self._server: ForkServer | None = None
        self._by_path: dict[str, int] = {}
        self._work: Path | None = None
        # Its temporary directories: removed by ``_close``, or by its watchdog if it dies first.
        self._temporary: list[str] = []
        self._watchdog: int | None = None
        self._cards: dict[str, Card] = {}
        self._root = Path.cwd()
        self._interrupts = 0
        self._node_id = ""

    # ------------------------------------------------------------------ called by the driver

    async def describe(self, ray_gpus: int = 0) -> NodeInfo:
        """This node's id, name, cards, cores and versions.

        ``ray_gpus``: how many GPUs Ray counts on this node. Where it counts
        some, the driver created this actor holding every one of them that was
        free (``num_gpus``), so that while the run lasts Ray gives none of them
        to other work; the cards this run uses are then exactly those Ray gave
        this actor (``held_cards``). Where Ray counts none (a node started with
        ``--num-gpus 0``, or simulated cards Ray does not know), the node's
        cards are outside Ray's accounting and all of them are used.
        """
        import ray  # only ever imported in a Ray worker

        node_id = self._node_id = ray.get_runtime_context().get_node_id()
        hostname = socket.gethostname()
        try:
            cards, simulated = node_cards()
        except ValueError as exc:
            return NodeInfo(node_id, hostname, (), False, 0, {}, os.getpid(), str(exc))
        granted = [str(gpu) for gpu in ray.get_gpu_ids()]
        if ray_gpus > 0:
            cards = held_cards(cards, simulated, granted)
        self._cards = {card.id: card for card in cards}
        return NodeInfo(
            node_id,
            hostname,
            tuple(cards),
            simulated,
            os.cpu_count() or 1,
            versions.local_versions(),
            os.getpid(),
            held=len(granted),
            taken=max(0, ray_gpus - len(granted)),
        )

    async def start(self, config: AgentConfig) -> None:
        """Prepare the runner (and fork server) and start it, waiting for files."""
        # This node's share of the run: its job tags (and its watchdog's sweep) start with it.
        config = dataclasses.replace(config, run_id=f"{config.run_id}-{self._node_id[:6]}")
        if config.code_root is not None:
            self._root = Path(config.code_root)
            os.chdir(self._root)  # children start here, as under Ray's working_dir
        tmp_root, tmp_warning = local_tmp_root(os.environ.get("TMPDIR"), read_mounts(), levels=2)
        if tmp_warning:
            self.emit(Note(f"gpusched: warning: {tmp_warning}"))
        self._work = Path(tempfile.mkdtemp(prefix="gpusched-agent-"))
        # The parent of its files' RAY_TMPDIRs, named as short as theirs for Ray's socket paths.
        ray_tmp_root = tempfile.mkdtemp(prefix="gs", dir=tmp_root)
        self._temporary = [str(self._work), ray_tmp_root]
        self._watchdog = watchdog.launch(f"{config.run_id}-", self._temporary)
        log_dir = self._work / "logs"
        log_dir.mkdir()
        simulated = bool(os.environ.get(SIMULATE_VARIABLE))
        run_config = RunConfig(
            pytest_args=config.pytest_args,
            timeout=config.timeout,
            kill_grace=config.kill_grace,
            simulated=simulated,
            log_dir=log_dir,
            work_dir=self._work,
            tmp_root=ray_tmp_root,
            run_id=config.run_id,
            reruns=config.reruns,
            rootdir=str(self._root),
            prestart=0,
            coverage=self._work / "coverage" if config.coverage else None,
        )
        for name in set(os.environ) - set(child_base_env(dict(os.environ))):
            del os.environ[name]  # the runner builds each child's environment from this one
        if config.fork_server:
            self._server = await asyncio.to_thread(self._start_server, config, log_dir)
        reporter = _Reporter(self)
        self._release = release_check(
            bool(self._cards) and not simulated,
            config.gpu_release_timeout,
            config.gpu_release_memory,
            warn=reporter.say,
        )
        releaser = self._release.__enter__()
        self._runner = Runner(
            run_config,
            self._policy,
            {},
            reporter,
            releaser,
            clock=time.time,
            forkserver=self._server,
            t0=config.t0,
            open_input=True,
            requeue=self._requeue,
        )
        self._run_task = asyncio.create_task(self._run())

    async def place(self, placed: Sequence[Placed]) -> None:
        """Start these files (their cards are free on this node by the driver's account)."""
        assert self._runner is not None, "place before start"
        jobs = []
        tests: dict[str, Sequence[str]] = {}
        expect: dict[str, str] = {}
        for item in placed:
            path = str(self._root / item.path)
            job = Job(item.job_id, path, item.requirement, item.expected)
            self._policy.place(job, [self._cards.get(card, Card(card)) for card in item.cards])
            self._by_path[path] = item.job_id
            tests[path] = item.tests
            if item.expect is not None:
                expect[path] = item.expect
            jobs.append(job)
        self._runner.submit(jobs, tests, expect)

    async def poll(self, wait: float = POLL_WAIT) -> list[AgentEvent]:
        """The events since the last poll; waits up to ``wait`` s for one (an empty answer: alive)."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if not self._events:
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait)
            except TimeoutError:
                pass
        self._wakeup.clear()
        events, self._events = self._events, []
        return events

    async def close_input(self) -> None:
        """No more files: the runner ends once the running ones are done."""
        if self._runner is not None:
            self._runner.close_input()

    async def interrupt(self) -> None:
        """Ctrl-C on the driver: kill every running file's tree (a second call: at once)."""
        self._interrupts += 1
        if self._runner is None:
            self.emit(AgentDone(True))
            return
        self._runner.interrupt(signal.SIGINT)

    async def stop(self) -> None:
        """After ``AgentDone``: close the fork server and the NVML handle, remove the work dir."""
        if self._run_task is not None:
            await self._run_task
        await asyncio.to_thread(self._close)

    # ------------------------------------------------------------------ internals

    def emit(self, event: AgentEvent) -> None:
        self._events.append(event)
        if self._wakeup is not None:
            self._wakeup.set()

    def finished(self, result: FileResult) -> None:
        """The runner's reporter heard an attempt end; ship it with its log and quarantine."""
        runner = self._runner
        assert runner is not None
        job_id = self._by_path[result.path]
        final = bool(runner.report.results) and runner.report.results[-1] is result
        log = _log_tail(result.log)
        quarantined = self._policy.quarantined.get(job_id, ())
        recollected = result.path in runner.recollected
        coverage = None
        if runner.config.coverage is not None:
            folder = runner.config.coverage / f"{job_id}-{result.attempts}"
            coverage = pack(folder)
            shutil.rmtree(folder, ignore_errors=True)
        self.emit(FileFinished(job_id, result, final, quarantined, log, recollected, coverage))

    def _requeue(self, job: Job, found: Recollected) -> None:
        """The runner's ``requeue``: the driver decides where the file runs now."""
        quarantined = self._policy.quarantined.get(job.id, ())
        self.emit(FileRequeued(job.id, found.requirement, found.levels, found.tests, quarantined))

    async def _run(self) -> None:
        assert self._runner is not None
        try:
            report = await self._runner.run([])
        finally:
            await asyncio.to_thread(self._close_server)
        self.emit(AgentDone(report.interrupted))

    def _start_server(self, config: AgentConfig, log_dir: Path) -> ForkServer | None:
        why = fork_unavailable()
        if why:
            self.emit(Note(f"gpusched: fork server off: {why}"))
            return None
        spec = ServerSpec(
            config.preload,
            tuple(name for name in auto_preload(["."], self._root) if name not in config.preload),
            dict(os.environ),
            log_dir / "forkserver.log",
            config.run_id,
            config.server_timeout,
            scratch=self._work,
        )
        startup = start_server(spec)
        for note in startup.notes:
            self.emit(Note(f"gpusched: {note}"))
        if startup.server is None:
            self.emit(Note(f"gpusched: fork server off on this node: {startup.reason}"))
        return startup.server

    def _close_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def _close(self) -> None:
        self._close_server()
        release = getattr(self, "_release", None)
        if release is not None:
            self._release = None
            release.__exit__(None, None, None)
        for path in self._temporary:
            shutil.rmtree(path, ignore_errors=True)
        self._temporary = []
        self._work = None
        if self._watchdog is not None:
            os.close(self._watchdog)  # the watchdog sweeps (nothing is left) and exits
            self._watchdog = None


def _log_tail(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - LOG_LIMIT))
            return log.read().decode("utf-8", errors="replace")
    except OSError:
        return None
