"""The driver's side of ``gpusched run --ray``: connect, start the agents, run the files, gather.

The driver is the single controller. ``connect`` joins the Ray cluster (and
ships the suite's root directory with Ray's ``working_dir``, unless the user
names a directory every node shares); ``start_agents`` places one
``NodeAgent`` actor on every alive node (node affinity, not soft) and reads
its cards, cores and versions; ``check_versions`` refuses a node whose
interpreter, pytest, gpusched or plugins differ. ``ClusterRun`` then asks the
pure ``ClusterPolicy`` where each file goes, sends each decision to the node's
agent, and turns what the agents send back into one stream of results for the
reporters. Ray is the transport (actor calls, a long poll per agent that is
also its heartbeat) and the membership (an agent whose node died fails its
calls), never the policy.

Faults: a node that leaves (its agent's calls fail, or it stays silent past
``silence`` seconds) has its running files placed again elsewhere, once;
Ctrl-C or SIGTERM makes every agent kill its files' trees and report them
INTERRUPTED, the files not started are NOT RUN. If an agent's process dies
anyway, its node's watchdog kills what is left of the run there.

Ray is imported here only, when the first function is called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpusched.atomic import atomic_write
from gpusched.coverage.data import unpack
from gpusched.execution.cluster import versions
from gpusched.execution.cluster.agent import (
    AGENT_RUNTIME_ENV,
    AgentConfig,
    AgentDone,
    AgentEvent,
    FileFinished,
    FileRequeued,
    FileStarted,
    NodeAgent,
    NodeInfo,
    Note,
    Placed,
)
from gpusched.execution.runner import Child, RevisesPending, log_name
from gpusched.reporting.report import display_path
from gpusched.requirements import Requirement, format_memory
from gpusched.results import FAILING, FileResult, Outcome, TestResult
from gpusched.scheduling.cluster import ClusterPolicy, Node, Placement, cluster_requirement
from gpusched.scheduling.packing import Job, Unschedulable
from rl_e2e import reach
from rl_e2e.reach import ClusterError

# Left out of what is shipped to the nodes, besides what .gitignore and the user exclude.
DEFAULT_EXCLUDES = (".git", ".gpusched", "__pycache__", "*.pyc", ".venv", ".tox", ".nox")
AGENT_START_TIMEOUT = 120.0  # seconds for every agent to be placed and to answer
SILENCE = 60.0  # seconds without an answer to a poll before an agent's node counts as lost
JOIN_CHECK = 3.0  # seconds between two looks at the cluster's membership for nodes that joined
STOP_BOUND = 30.0  # seconds, after the kill grace, for agents to confirm their files are over


@dataclass(frozen=True)
class CodeSpec:
    """Where the suite's code comes from on the nodes.

    ``root`` is the suite's root directory here. With ``shared`` (the same
    directory as every node sees it) nothing is shipped; without it ``root`` is
    shipped with Ray's ``working_dir``, leaving out ``excludes`` (gitignore-style
    patterns) and what ``.gitignore`` files exclude.
    """

    root: Path
    shared: str | None = None
    excludes: tuple[str, ...] = ()


@dataclass
class Agent:
    """One node's agent as the driver holds it."""

    info: NodeInfo
    name: str
    actor: Any
    cpu_slots: int
    done: bool = False
    lost: str | None = None  # why the node left the run
    heard: float = field(default_factory=time.monotonic)
    starting: Any = None  # the reference of a ``start`` already sent (``send_start``)


def send_start(agents: Sequence[Agent], config: AgentConfig) -> None:
    """Ask every agent to start its runner and fork server now, without waiting: they start
    while the driver still collects; ``ClusterRun.run`` waits for them."""
    for agent in agents:
        agent.starting = agent.actor.start.remote(config)


def connect(address: str, code: CodeSpec | None) -> None:
    """Join the cluster at ``address`` (``ray.init``), shipping ``code.root`` unless it is shared.

    ``reach.prepare`` checks the address first and sets this process's token
    mode from what the cluster wants, so a wrong address or a missing token is
    one line (ClusterError), without Ray's minutes of retries and log lines.
    """
    import ray
    from ray.exceptions import AuthenticationError

    runtime_env = None
    if code is not None and code.shared is None:
        runtime_env = {
            "working_dir": str(code.root),
            "excludes": [*DEFAULT_EXCLUDES, *code.excludes],
        }
    target = reach.prepare(address)
    try:
        ray.init(
            address=target,
            runtime_env=runtime_env,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as exc:
        raise ClusterError(f"--ray {address}: no Ray cluster there ({exc})") from None
    except AuthenticationError as exc:
        raise ClusterError(f"--ray {address}: {_first_line(exc)}") from None
    except ValueError as exc:  # a working_dir Ray refuses (too large, unreadable)
        raise ClusterError(
            f"--ray {address}: cannot ship {code.root if code else ''}: {exc}"
        ) from None


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def node_names(infos: Sequence[NodeInfo]) -> list[str]:
    """Each node's host name, with the start of its id where two nodes share a host name."""
    hosts = [info.hostname for info in infos]
    return [
        info.hostname if hosts.count(info.hostname) == 1 else f"{info.hostname}-{info.node_id[:6]}"
        for info in infos
    ]


def start_agents(cpu_slots: int, timeout: float = AGENT_START_TIMEOUT) -> list[Agent]:
    """One agent per alive node, pinned to it; each has answered ``describe``.

    A node runs at most ``cpu_slots`` CPU files at once, and no more than Ray
    counts CPUs on it (at least one). Where Ray counts GPUs on a node, its agent
    is created holding all of them that are free (``num_gpus``): Ray then gives
    none of them to other work until the run ends and its actors are gone, and
    the run uses only those (``NodeAgent.describe``). Raises ClusterError naming
    the nodes whose agent could not start.
    """
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if not nodes:
        raise ClusterError("the Ray cluster has no alive node")
    free = ray_free_gpus()
    actors = [create_agent(node, free) for node in nodes]
    answers = [
        actor.describe.remote(ray_gpus(node)) for actor, node in zip(actors, nodes, strict=True)
    ]
    ready, _ = ray.wait(answers, num_returns=len(answers), timeout=timeout)
    infos: list[NodeInfo] = []
    problems = []
    for node, answer in zip(nodes, answers, strict=True):
        where = node_place(node)
        if answer not in ready:
            problems.append(f"{where}: its agent did not start within {timeout:g}s")
            continue
        try:
            info = ray.get(answer)
        except Exception as exc:  # noqa: BLE001 - anything the actor raised, named below
            problems.append(f"{where}: its agent failed to start: {_first_line(exc)}")
            continue
        if info.error:
            problems.append(f"{where}: {info.error}")
        infos.append(info)
    if problems:
        for actor in actors:
            ray.kill(actor)
        raise ClusterError("; ".join(problems))
    by_id = {node["NodeID"]: node for node in nodes}
    return [
        Agent(info, name, actor, node_cpu_slots(by_id.get(info.node_id, {}), cpu_slots))
        for info, name, actor in zip(infos, node_names(infos), actors, strict=True)
    ]


def create_agent(node: Mapping[str, Any], free_gpus: Mapping[str, int]) -> Any:
    """The agent actor for a node (an entry of ``ray.nodes()``), pinned to it, holding the
    node's free GPUs in Ray's accounting where Ray counts any (see ``start_agents``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(NodeAgent)
    return remote.options(
        num_gpus=free_gpus.get(node["NodeID"], 0) if ray_gpus(node) else 0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        runtime_env=AGENT_RUNTIME_ENV,
    ).remote()


def node_place(node: Mapping[str, Any]) -> str:
    """A node for messages before its agent named it: host, start of its id, address."""
    return (
        f"node {node['NodeManagerHostname']} ({node['NodeID'][:6]}, {node['NodeManagerAddress']})"
    )


def node_cpu_slots(node: Mapping[str, Any], cpu_slots: int) -> int:
    """CPU files at once on a node: at most ``cpu_slots``, no more than Ray counts CPUs (>= 1)."""
    return max(1, min(cpu_slots, int(node.get("Resources", {}).get("CPU", 1))))


def describe_node(agent: Agent) -> str:
    """``gpu-2 (4 cards of 80GB, 2 CPU slots)``: a node as the console names it."""
    cards = agent.info.cards
    kind = "simulated " if agent.info.simulated else ""
    sizes = {card.memory for card in cards if card.memory}
    memory = f" of {'/'.join(format_memory(m) for m in sorted(sizes))}" if sizes else ""
    return f"{agent.name} ({len(cards)} {kind}cards{memory}, {agent.cpu_slots} CPU slots)"


def ray_gpus(node: Mapping[str, Any]) -> int:
    """How many whole GPUs Ray counts on a node (an entry of ``ray.nodes()``)."""
    return int(node.get("Resources", {}).get("GPU", 0))


def ray_free_gpus() -> dict[str, int]:
    """Node id -> whole GPUs no Ray work holds now (a snapshot: it may change at once)."""
    from ray._private.state import available_resources_per_node

    return {
        node_id: int(resources.get("GPU", 0))
        for node_id, resources in available_resources_per_node().items()
    }


def describe_holdings(agents: Sequence[Agent]) -> list[str]:
    """A line per node where other Ray work held some of its GPUs when the run started."""
    return [
        f"gpusched: node {agent.name}: {agent.info.taken} of its GPUs are held by other Ray "
        f"work; this run uses the other {len(agent.info.cards)}"
        for agent in agents
        if agent.info.taken
    ]


def check_versions(agents: Sequence[Agent], here: Mapping[str, str] | None = None) -> None:
    """Refuse to run if a node's versions differ from the driver's; the message names each."""
    mine = dict(here if here is not None else versions.local_versions())
    problems = []
    for agent in agents:
        diff = versions.differences(mine, agent.info.versions)
        if diff:
            problems.append(f"node {agent.name}: " + "; ".join(diff))
    if problems:
        raise ClusterError(
            "the nodes must run the same interpreter, pytest, gpusched and pytest plugins "
            "as this machine (here = the driver, there = the node): " + " | ".join(problems)
        )


def policy_nodes(agents: Sequence[Agent]) -> list[Node]:
    return [Node(a.info.node_id, a.name, a.info.cards, a.cpu_slots) for a in agents]


class ClusterReporter(Protocol):
    """Who hears about a cluster run's progress (the session's console or live view)."""

    def started(self, job: Job, node: str, cards: tuple[str, ...], attempt: int) -> None: ...

    def finished(self, result: FileResult) -> None: ...

    def interrupting(self, signum: int, second: bool) -> None: ...

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None: ...

    def joined(self, node: str, cards: tuple[str, ...], cpu_slots: int) -> None:
        """A node joined the run with these (idle) cards and CPU slots."""

    def say(self, line: str) -> None: ...


@dataclass
class ClusterReport:
    """What a cluster run produced, for the reports (as ``RunReport`` on one node)."""

    results: list[FileResult] = field(default_factory=list)
    interrupted: bool = False
    quarantined: list[str] = field(default_factory=list)  # "node:card"
    lost: list[tuple[str, str]] = field(default_factory=list)  # (node, why)


@dataclass(frozen=True)
class _Events:
    node: str
    events: list[AgentEvent]


@dataclass(frozen=True)
class _Lost:
    node: str
    reason: str


@dataclass(frozen=True)
class _Signal:
    signum: int


@dataclass(frozen=True)
class _Tick:
    pass


@dataclass(frozen=True)
class _Joined:
    """A node that joined during the run: its agent answered, matches and was started."""

    agent: Agent


@dataclass(frozen=True)
class _Refused:
    """A node that joined during the run and will not be used: the line that says why."""

    node: str
    line: str


@dataclass(frozen=True)
class _Wake:
    """Files were submitted while the run goes on (``ClusterRun.submit``): place them."""


_DriverEvent = _Events | _Lost | _Signal | _Tick | _Joined | _Refused | _Wake


class ClusterRun(RevisesPending):
    """One run across the agents: places files, gathers results, handles lost nodes and Ctrl-C.

    With ``open_input`` files may come while it runs (``submit``, ``revise``: the
    same calls as the local ``Runner``'s, so ``gpusched.feed.Feeder`` feeds either
    from the streaming collection) until ``close_input``. ``expect`` holds the
    collection cache's prediction of each file's requirement and tests, which the
    file's child checks on its node; a child that finds it needs other cards
    stops before its tests and the file is placed again (``FileRequeued``).
    """

    def __init__(
        self,
        agents: Sequence[Agent],
        config: AgentConfig,
        tests: Mapping[str, Sequence[str]],
        reporter: ClusterReporter,
        *,
        root: Path,
        log_dir: Path,
        exitfirst: bool = False,
        heartbeat: float | None = None,
        silence: float = SILENCE,
        cpu_slots: int = 1,
        join_check: float | None = JOIN_CHECK,
        open_input: bool = False,
        expect: Mapping[str, str] | None = None,
        coverage: Path | None = None,
    ) -> None:
        """``coverage``: a measuring run's folder, where each node's attempts land as
        ``NODE/KEY`` (``gpusched.coverage.data``)."""
        self.agents = {agent.info.node_id: agent for agent in agents}
        self.policy = ClusterPolicy(policy_nodes(agents))
        self.config = config
        self.tests = dict(tests)
        self.reporter = reporter
        self.root = root
        self.log_dir = log_dir
        self.exitfirst = exitfirst
        self.heartbeat = heartbeat
        self.silence = silence
        self.report = ClusterReport()
        self.jobs: dict[int, Job] = {}
        self.started: dict[int, float] = {}  # running job -> monotonic start, for --heartbeat
        self.lost_once: dict[int, str] = {}  # job id -> the node lost while it ran there
        self.interrupted = False  # Ctrl-C: no new file, every agent kills its files
        self.no_new = False  # -x after a failure: no new file, running ones finish
        self.events: asyncio.Queue[_DriverEvent] = asyncio.Queue()
        self.relative: dict[int, str] = {}  # job id -> its path under the root, as nodes see it
        self.cpu_slots = cpu_slots  # for nodes that join: at most this many CPU files each
        self.join_check = join_check  # seconds between looks for nodes that joined; None: never
        self.joining: dict[str, Any] = {}  # node id -> the actor of its agent, not yet in the run
        self.refused: set[str] = set()  # nodes that joined but are not used (a version differs)
        self.tasks: list[asyncio.Task] = []  # pollers, joins: cancelled at the end
        self.input_open = open_input
        self.stop_reason = "-x"  # why pending files did not start, once no_new
        self.expect = dict(expect or {})  # path -> the collection cache's prediction
        self.recollected: set[str] = set()  # files whose child found the cache wrong
        self.coverage = coverage
        self._next_beat = time.monotonic() + (heartbeat or 0.0)

    async def run(self, jobs: Sequence[Job]) -> ClusterReport:
        """Run ``jobs`` to the end (or to an interrupt) and return every file's final result."""
        loop = asyncio.get_running_loop()
        self.jobs.update({job.id: job for job in jobs})
        self.relative.update({job.id: self._relative(job.path) for job in jobs})
        starts = [
            (a, a.starting if a.starting is not None else a.actor.start.remote(self.config))
            for a in self.agents.values()
        ]
        for agent, start in starts:
            try:
                await _call(start)
            except Exception as exc:  # noqa: BLE001 - its node left before the run began
                self._node_lost(agent.info.node_id, _first_line(exc))
        self.tasks = [asyncio.create_task(self._poll(agent)) for agent in self.agents.values()]
        ticker = asyncio.create_task(self._tick())
        if self.join_check is not None:
            self.tasks.append(asyncio.create_task(self._watch_joins(self.join_check)))
        installed = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, self.events.put_nowait, _Signal(signum))
                installed.append(signum)
            except (RuntimeError, ValueError, NotImplementedError):
                pass
        self.policy.submit(jobs)
        try:
            await self._loop()
            await self._close()
        except (asyncio.CancelledError, KeyboardInterrupt):
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._interrupt(signal.SIGINT)
            await self._loop()
            await self._close()
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)
            ticker.cancel()
            for task in self.tasks:
                task.cancel()
            self._drop_joining()
        for job in self.policy.cancel_pending():
            self._not_run(job)
        return self.report

    # ------------------------------------------------------------------ files that come later

    @property
    def stopping(self) -> bool:
        """No new file starts: Ctrl-C, ``-x`` after a failure, or ``stop``."""
        return self.interrupted or self.no_new

    def refit(self, requirement: Requirement, levels: tuple[Requirement, ...]) -> Requirement:
        """A file's requirement lowered to what some node of the run can give it now."""
        return cluster_requirement(requirement, levels, self.policy.nodes)

    def submit(
        self,
        jobs: Sequence[Job],
        tests: Mapping[str, Sequence[str]] | None = None,
        expect: Mapping[str, str] | None = None,
    ) -> None:
        """Add files while the run goes on (``open_input``); call on the run's event loop.

        ``tests`` and ``expect``: the new files' test ids and collection cache predictions.
        A file outside the directory the nodes have is an error result at once.
        """
        self.tests.update({path: tuple(ids) for path, ids in (tests or {}).items()})
        self.expect.update(expect or {})
        placeable = []
        for job in jobs:
            try:
                self.relative[job.id] = self._relative(job.path)
            except ClusterError as exc:
                self._record(FileResult(job.path, Outcome.ERROR, message=str(exc)))
                continue
            self.jobs[job.id] = job
            placeable.append(job)
        self.policy.submit(placeable)
        self.events.put_nowait(_Wake())

    def adopt(self, job: Job, child: Child, tests: Sequence[str] = ()) -> None:
        """Early starts are a one-machine feature: no cluster run is ever given one."""
        raise RuntimeError(f"{job.path}: a cluster run adopts no early start")

    def release_reserved(self) -> None:
        """Nothing is reserved: the collection runs on the driver, outside every node's slots."""

    def stop(self, reason: str) -> None:
        """Start no new file; the running ones finish, the pending ones are NOT RUN (``reason``)."""
        self.no_new = True
        self.stop_reason = reason
        for job in self.policy.cancel_pending():
            self._not_run(job, f"not started ({reason})")
        self.events.put_nowait(_Wake())

    def close_input(self) -> None:
        """No more files will be submitted: ``run`` ends once the last one is done."""
        self.input_open = False
        self.events.put_nowait(_Wake())

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            if not (self.stopping):
                self._place()
            if not self.policy.running and (
                self.stopping or not (self.input_open or self.policy.has_pending)
            ):
                return
            match await self.events.get():
                case _Events(node, events):
                    self._heard(node, events)
                case _Lost(node, reason):
                    self._node_lost(node, reason)
                case _Signal(signum):
                    self._interrupt(signum)
                case _Tick():
                    self._check_silence()
                case _Joined(agent):
                    self._joined(agent)
                case _Refused(node, line):
                    self.joining.pop(node, None)
                    self.refused.add(node)
                    self.reporter.say(line)
                case _Wake():
                    pass

    async def _close(self) -> None:
        """Every file is over: let the agents end and confirm (bounded), then stop them."""
        live = [a for a in self.agents.values() if a.lost is None and not a.done]
        for agent in live:
            agent.actor.close_input.remote()
        deadline = time.monotonic() + self.config.kill_grace + STOP_BOUND
        while any(a.lost is None and not a.done for a in self.agents.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                event = await asyncio.wait_for(self.events.get(), left)
            except TimeoutError:
                break
            match event:
                case _Events(node, events):
                    self._heard(node, events)
                case _Lost(node, reason):
                    self._node_lost(node, reason)
                case _Signal(signum):
                    self._interrupt(signum)
        stops = [a.actor.stop.remote() for a in self.agents.values() if a.lost is None and a.done]
        for stop in stops:
            try:
                await asyncio.wait_for(_call(stop), STOP_BOUND)
            except Exception:  # noqa: BLE001 - ending anyway; the node's watchdog cleans up
                pass

    def _place(self) -> None:
        by_node: dict[str, list[Placed]] = {}
        for decision in self.policy.schedule():
            match decision:
                case Placement(node, assignment):
                    job = assignment.job
                    cards = tuple(card.id for card in assignment.cards)
                    by_node.setdefault(node, []).append(
                        Placed(
                            job.id,
                            self.relative[job.id],
                            job.requirement,
                            job.expected,
                            cards,
                            tuple(self.tests.get(job.path, ())),
                            self.expect.get(job.path),
                        )
                    )
                case Unschedulable(job, reason):
                    self._record(
                        FileResult(
                            job.path,
                            Outcome.SKIPPED,
                            message=reason,
                            tests=[
                                TestResult(nodeid, "skipped", 0.0, reason)
                                for nodeid in self.tests.get(job.path, ())
                            ],
                        )
                    )
        for node, placed in by_node.items():
            self.agents[node].actor.place.remote(placed)

    def _heard(self, node: str, events: list[AgentEvent]) -> None:
        agent = self.agents[node]
        agent.heard = time.monotonic()
        if agent.lost is not None:
            return  # it was given up on; its files already went elsewhere
        for event in events:
            match event:
                case FileStarted(job_id, cards, attempt):
                    self.started[job_id] = time.monotonic()
                    job = self.jobs[job_id]
                    self.reporter.started(job, agent.name, cards, attempt)
                case FileFinished(job_id, result, final, quarantined, log, recollected, data):
                    if recollected:
                        self.recollected.add(self.jobs[job_id].path)
                    if data and self.coverage is not None:
                        unpack(data, self.coverage / agent.name / f"{job_id}-{result.attempts}")
                    self._finished(agent, job_id, result, final, quarantined, log)
                case FileRequeued(job_id, requirement, levels, tests, quarantined):
                    self._requeued(agent, job_id, requirement, levels, tests, quarantined)
                case Note(text):
                    self.reporter.say(f"{text} (node {agent.name})")
                case AgentDone():
                    agent.done = True

    def _finished(
        self,
        agent: Agent,
        job_id: int,
        result: FileResult,
        final: bool,
        quarantined: tuple[str, ...],
        log: str | None,
    ) -> None:
        job = self.jobs[job_id]
        result.path = job.path
        result.node = agent.name
        if log is not None:
            target = self.log_dir / log_name(job.path, str(self.root))
            try:
                atomic_write(str(target), log)
                result.log = str(target)
            except OSError:
                result.log = None
        else:
            result.log = None
        if job_id in self.lost_once:
            again = f"ran again after node {self.lost_once[job_id]} was lost"
            result.message = f"{result.message}; {again}" if result.message else again
        if not final:
            self.reporter.finished(result)  # a failed attempt; the agent runs it again
            return
        self.started.pop(job_id, None)
        self.policy.complete(job_id, quarantined)
        self.report.quarantined.extend(f"{agent.name}:{card}" for card in quarantined)
        self._record(result)
        if self.exitfirst and result.outcome in FAILING and not self.no_new:
            self.no_new = True
            for pending in self.policy.cancel_pending():
                self._not_run(pending, "not started (-x)")

    def _requeued(
        self,
        agent: Agent,
        job_id: int,
        requirement: Requirement,
        levels: tuple[Requirement, ...],
        tests: tuple[str, ...],
        quarantined: tuple[str, ...],
    ) -> None:
        """The file's child found other cards than predicted and ran no test: place it again
        with what it found (from now on its own collection is the truth, nothing is checked)."""
        job = self.jobs[job_id]
        self.started.pop(job_id, None)
        self.recollected.add(job.path)
        self.expect.pop(job.path, None)
        self.tests[job.path] = tests
        self.report.quarantined.extend(f"{agent.name}:{card}" for card in quarantined)
        if self.stopping:
            self.policy.complete(job_id, quarantined)
            why = "interrupted" if self.interrupted else self.stop_reason
            self._not_run(job, f"not started ({why})")
            return
        again = dataclasses.replace(job, requirement=self.refit(requirement, levels))
        self.jobs[job_id] = again
        self.policy.requeue(again, quarantined)
        self.reporter.say(
            f"gpusched: {display_path(job.path)} needs {requirement.describe()}, not the "
            f"{job.requirement.describe()} the collection cache predicted: queued again"
        )

    def _node_lost(self, node: str, reason: str) -> None:
        agent = self.agents[node]
        if agent.lost is not None or agent.done:
            return
        agent.lost = reason
        self.report.lost.append((agent.name, reason))
        lost = self.policy.remove_node(node)
        names = ", ".join(os.path.relpath(job.path) for job in lost) or "none"
        self.reporter.say(
            f"gpusched: node {agent.name} left the run ({reason}); "
            f"its {len(lost)} running file(s) go to other nodes: {names}"
        )
        for job in lost:
            self.started.pop(job.id, None)
            if self.interrupted:
                self._record(
                    FileResult(job.path, Outcome.INTERRUPTED, node=agent.name, message=reason)
                )
            elif job.id in self.lost_once:
                self._record(
                    FileResult(
                        job.path,
                        Outcome.CRASHED,
                        node=agent.name,
                        message=f"its node was lost twice ({self.lost_once[job.id]}, then "
                        f"{agent.name}: {reason})",
                        tests=[
                            TestResult(nodeid, "crashed", 0.0, reason)
                            for nodeid in self.tests.get(job.path, ())
                        ],
                    )
                )
            else:
                self.lost_once[job.id] = agent.name
                self.policy.submit([job])

    def _interrupt(self, signum: int) -> None:
        second = self.interrupted
        self.reporter.interrupting(signum, second)
        self.report.interrupted = True
        self.interrupted = True
        if not second:
            for job in self.policy.cancel_pending():
                self._not_run(job)
        for agent in self.agents.values():
            if agent.lost is None and not agent.done:
                agent.actor.interrupt.remote()

    def _check_silence(self) -> None:
        now = time.monotonic()
        for node, agent in self.agents.items():
            if agent.lost is None and not agent.done and now - agent.heard > self.silence:
                import ray

                ray.kill(
                    agent.actor, no_restart=True
                )  # if it is alive after all: its watchdog cleans up
                self._node_lost(node, f"its agent did not answer for {self.silence:g}s")
        if self.heartbeat and now >= self._next_beat:
            self._next_beat += self.heartbeat
        else:
            return
        if self.started:
            self.reporter.heartbeat(
                sorted(
                    ((self.jobs[job_id], now - since) for job_id, since in self.started.items()),
                    key=lambda item: -item[1],
                )
            )

    # ------------------------------------------------------------------ nodes that join

    async def _watch_joins(self, every: float) -> None:
        """Every ``every`` s while files wait: start an agent on each alive node not in the run."""
        import ray

        while True:
            await asyncio.sleep(every)
            if self.stopping or not self.policy.has_pending:
                continue
            nodes = await asyncio.to_thread(ray.nodes)
            new = [
                node
                for node in nodes
                if node.get("Alive")
                and node["NodeID"] not in self.agents
                and node["NodeID"] not in self.joining
                and node["NodeID"] not in self.refused
            ]
            if not new:
                continue
            free = await asyncio.to_thread(ray_free_gpus)
            for node in new:
                self.joining[node["NodeID"]] = actor = create_agent(node, free)
                self.tasks.append(asyncio.create_task(self._join(node, actor)))

    async def _join(self, node: Mapping[str, Any], actor: Any) -> None:
        """Describe, check and start the agent of a node that joined; tell the loop the outcome.

        A node whose versions differ from the driver's is refused as at the
        start, but with one line, and the run goes on without it; its agent is
        killed before it was started, so nothing of the run ever ran there.
        """
        import ray

        node_id = node["NodeID"]
        try:
            info = await asyncio.wait_for(
                _call(actor.describe.remote(ray_gpus(node))), AGENT_START_TIMEOUT
            )
        except Exception as exc:  # noqa: BLE001 - named in the line
            ray.kill(actor, no_restart=True)
            why = "did not start in time" if isinstance(exc, TimeoutError) else _first_line(exc)
            line = f"gpusched: {node_place(node)} joined, but its agent {why}: not used"
            self.events.put_nowait(_Refused(node_id, line))
            return
        infos = [agent.info for agent in self.agents.values()] + [info]
        name = node_names(infos)[-1]
        diff = versions.differences(self.versions_here, info.versions)
        if info.error or diff:
            ray.kill(actor, no_restart=True)
            why = info.error or (
                "it must run the same interpreter, pytest, gpusched and pytest plugins "
                "as this machine (here = the driver, there = the node): " + "; ".join(diff)
            )
            line = f"gpusched: node {name} joined but is not used: {why}"
            self.events.put_nowait(_Refused(node_id, line))
            return
        try:
            await _call(actor.start.remote(self.config))
        except Exception as exc:  # noqa: BLE001 - it left again at once
            ray.kill(actor, no_restart=True)
            line = f"gpusched: node {name} joined and left at once: {_first_line(exc)}"
            self.events.put_nowait(_Refused(node_id, line))
            return
        cpu = node_cpu_slots(node, self.cpu_slots)
        self.events.put_nowait(_Joined(Agent(info, name, actor, cpu)))

    @functools.cached_property
    def versions_here(self) -> dict[str, str]:
        """The driver's versions, which a node that joins must match."""
        return versions.local_versions()

    def _joined(self, agent: Agent) -> None:
        """Called by the loop: the node takes files from the next decision on."""
        node_id = agent.info.node_id
        self.joining.pop(node_id, None)
        self.agents[node_id] = agent
        if self.stopping:
            agent.actor.close_input.remote()  # nothing for it: it ends, ``_close`` stops it
        else:
            self.policy.add_node(policy_nodes([agent])[0])
            self.reporter.say(f"gpusched: node {describe_node(agent)} joined the run")
            cards = tuple(card.id for card in agent.info.cards)
            self.reporter.joined(agent.name, cards, agent.cpu_slots)
        self.tasks.append(asyncio.create_task(self._poll(agent)))

    def _drop_joining(self) -> None:
        """The run is over: agents of nodes still joining go (their watchdogs clean up)."""
        import ray

        for actor in self.joining.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.joining.clear()

    # ------------------------------------------------------------------ helpers

    async def _poll(self, agent: Agent) -> None:
        """Fetch the agent's events until it is done; a failed call means its node is lost."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        while not agent.done and agent.lost is None:
            try:
                events = await _call(agent.actor.poll.remote())
            except ActorUnavailableError:
                await asyncio.sleep(0.5)  # transient: silence decides if it lasts
                continue
            except RayActorError as exc:
                self.events.put_nowait(_Lost(agent.info.node_id, _first_line(exc)))
                return
            self.events.put_nowait(_Events(agent.info.node_id, events))
            if any(isinstance(event, AgentDone) for event in events):
                return

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.events.put_nowait(_Tick())

    def _relative(self, path: str) -> str:
        relative = os.path.relpath(path, self.root)
        if relative.startswith(".."):
            raise ClusterError(f"{path} is outside {self.root}, the directory the nodes have")
        return relative

    def _record(self, result: FileResult) -> None:
        self.report.results.append(result)
        self.reporter.finished(result)

    def _not_run(self, job: Job, message: str = "not started (interrupted)") -> None:
        self._record(
            FileResult(
                job.path,
                Outcome.NOT_RUN,
                message=message,
                tests=[TestResult(nodeid, "not run") for nodeid in self.tests.get(job.path, ())],
            )
        )


async def _call(ref: Any) -> Any:
    """Await a Ray object reference on this event loop."""
    return await asyncio.wrap_future(ref.future())


def _first_line(exc: BaseException) -> str:
    """What went wrong, in one line: for an error raised inside an actor, the original one."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip().rstrip(":")
