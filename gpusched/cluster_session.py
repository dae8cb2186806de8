"""The session of ``gpusched run --ray`` and ``gpusched plan --ray``: one run across a Ray cluster.

The same stages as on one machine (``gpusched.session``): collection here, on
the driver; then, instead of this machine's cards, the cluster's nodes and
theirs (``gpusched.execution.cluster``); the same reports at the end, each
file with its node. ``gpusched.session`` hands over to this module when the
``ray`` option is set; nothing imports Ray otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gpusched import EXIT_FAILED, EXIT_OK, EXIT_USAGE, STATE_DIR, session
from gpusched.collection.collect import Collection, CollectionFailed
from gpusched.collection.stream import POLL, collect_streaming
from gpusched.coverage.request import coverage_requested
from gpusched.ending import RunEnd, end_run, finish
from gpusched.execution.cluster.agent import AgentConfig
from gpusched.execution.cluster.driver import (
    Agent,
    ClusterError,
    ClusterRun,
    CodeSpec,
    check_versions,
    connect,
    describe_holdings,
    describe_node,
    disconnect,
    policy_nodes,
    send_start,
    start_agents,
)
from gpusched.execution.forkclient import (
    EarlyServer,
    ForkServer,
    new_run_id,
    server_start_timeout,
)
from gpusched.feed import Backlog, Feeder
from gpusched.history import HISTORY_FILE, load_durations
from gpusched.inventory import Card
from gpusched.options import UsageError, check_paths
from gpusched.reporting.report import ConsoleReporter, display_path, format_place
from gpusched.results import FileResult
from gpusched.scheduling.cluster import cluster_requirement, simulate_cluster
from gpusched.scheduling.packing import Job
from rl_e2e.reach import parse_address

RAY_LOG = "ray.log"  # under .gpusched/logs: what Ray itself printed on the driver
T = TypeVar("T")


def check_settings(settings: dict[str, Any]) -> None:
    """Refuse, before collection, options that mean nothing across a cluster and a malformed
    ``--ray`` address (a web address, a port without a host): each a usage error."""
    address = settings["ray"]
    if address != "auto" and not address.startswith("ray://"):
        try:
            parse_address(address)
        except ValueError as exc:
            raise UsageError(f"--ray {address}: {exc}") from None
    for name, flag in (("gpus", "--gpus"), ("simulate_gpus", "--simulate-gpus")):
        if settings.get(name):
            raise UsageError(
                f"{flag} picks the cards of one machine; with --ray each node offers its own: "
                "set CUDA_VISIBLE_DEVICES (real cards) or GPUSCHED_SIMULATE_GPUS (simulated "
                "ones) in the environment of that node's `ray start`"
            )


class NodeReporter:
    """The driver's ``ClusterReporter``: the console's (or live view's) lines, with each file's node."""

    def __init__(self, inner: Any, live: bool) -> None:
        self.inner = inner
        self.live = live

    def started(self, job: Job, node: str, cards: tuple[str, ...], attempt: int) -> None:
        if self.live:  # its rows are the cards of every node, named node:card
            self.inner.started(job, tuple(f"{node}:{card}" for card in cards), attempt)
            return
        again = f" (attempt {attempt})" if attempt > 1 else ""
        self.inner.say(
            f"{'START':<11} {display_path(job.path)} [{format_place(cards, node)}]{again}"
        )

    def finished(self, result: FileResult) -> None:
        self.inner.finished(result)

    def interrupting(self, signum: int, second: bool) -> None:
        self.inner.interrupting(signum, second)

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        self.inner.heartbeat(running)

    def joined(self, node: str, cards: tuple[str, ...], cpu_slots: int) -> None:
        """The live view gets the node's cards and slots as rows, idle until files come."""
        if self.live:
            self.inner.add_slots(tuple(f"{node}:{card}" for card in cards), cpu_slots)

    def say(self, line: str) -> None:
        self.inner.say(line)


def run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
    early: EarlyServer | None = None,
) -> int:
    """``gpusched run --ray``: collect here while the cluster starts, run each file across the
    cluster as soon as collection found it, report here. The exit code."""
    reporter = reporter or ConsoleReporter()
    check_settings(settings)
    session.check_per_test_timeout(settings)
    check_paths(paths)
    run_id = early.spec.run_id if early is not None else new_run_id()
    local = {**settings, "simulate_gpus": "0", "gpus": None}  # collection: no cards here
    try:
        with session.fork_server(paths, local, run_id, reporter, early) as server, ray_messages():
            return _run(paths, settings, pytest_args, reporter, server, run_id)
    except ClusterError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted before the run started")
        return finish(RunEnd([], [], ".", interrupted=True), settings, reporter)


@contextlib.contextmanager
def ray_messages() -> Iterator[None]:
    """Ray's own messages to the driver go to ``.gpusched/logs/ray.log``; disconnect at the end.

    Ray prints what its nodes report (a raylet that died, with its last log
    lines) on the driver's standard output, at any time, even after the
    summary line. gpusched reports those events itself (a lost node, its files
    run elsewhere), so Ray's text goes to a log. The reporters keep the real
    output: they took it when they were built.
    """
    log_dir = STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / RAY_LOG, "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        try:
            yield
        finally:
            disconnect()


@dataclass
class _Cluster:
    """The cluster as the run found it: its agents, ready for files."""

    agents: list[Agent]


class _NotMainThread(logging.Filter):
    """Ray's warning that ``ray.init`` outside the main thread sets no SIGTERM handler: the
    run's event loop handles SIGTERM itself (``ClusterRun``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not the main thread" not in record.getMessage()


def start_cluster(root: Path, settings: dict[str, Any], config: AgentConfig) -> _Cluster:
    """Connect (shipping ``root`` unless the nodes share it), place and check every node's
    agent, and send each its ``start`` (its fork server boots while collection goes on).
    Runs in a thread of its own beside the collection; raises ClusterError."""
    logging.getLogger("ray._private.worker").addFilter(_NotMainThread())
    shared = settings.get("ray_shared")
    connect(settings["ray"], CodeSpec(root, shared, tuple(settings.get("ray_excludes", ()))))
    agents = start_agents(settings["cpu_slots"])
    check_versions(agents)
    send_start(agents, config)
    return _Cluster(agents)


async def in_thread(work: Callable[[], T]) -> T:
    """``work()`` in a daemon thread: unlike ``asyncio.to_thread``, an interrupted run does not
    wait at exit for a connection still under way."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome: tuple[T | None, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="gpusched-cluster-start", daemon=True).start()
    return await future


@dataclass
class _Ran:
    """What the collection and the cluster run left, for the reports."""

    collection: Collection | None = None
    failure: CollectionFailed | None = None
    feeder: Feeder | None = None
    run: ClusterRun | None = None


def _run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    run_id: str,
) -> int:
    selection = session.selection_args(settings)
    args = [*selection, *pytest_args]
    cache = session.collection_cache(paths, settings, args)
    measures = coverage_requested(paths, pytest_args, os.environ, Path.cwd())
    history, warning = load_durations(STATE_DIR / HISTORY_FILE, settings["durations_seed"])
    if warning:
        reporter.say(f"gpusched: warning: {warning}")
    folder = (
        tempfile.TemporaryDirectory(prefix="gpusched-coverage-")
        if measures
        else contextlib.nullcontext(None)
    )
    with folder as made:
        coverage = Path(made) if made is not None else None
        ran = asyncio.run(
            _collect_and_run(
                paths,
                args,
                settings,
                pytest_args,
                reporter,
                server,
                cache,
                history,
                run_id,
                coverage,
            )  # fmt: skip
        )
        return _end(ran, settings, reporter, cache, coverage)


def _end(
    ran: _Ran,
    settings: dict[str, Any],
    reporter: ConsoleReporter,
    cache: tuple[Path, str] | None,
    coverage: Path | None,
) -> int:
    """The cluster run's own bookkeeping, then the end every run shares (``end_run``)."""
    collection, failure, feeder, cluster_run = ran.collection, ran.failure, ran.feeder, ran.run
    if failure is not None and cluster_run is None:  # the collection failed before any node
        if failure.exit_code == EXIT_USAGE:
            raise UsageError(str(failure)) from None
        reporter.say(f"gpusched: {failure}")
        return failure.exit_code
    assert feeder is not None and cluster_run is not None
    disconnect()  # the agents are done: nothing from Ray after the summary
    results = feeder.results + cluster_run.report.results
    report = cluster_run.report
    rootdir = feeder.rootdir
    if collection is not None and cache is not None:
        session.remember_collection(cache[0], collection)
        session.forget_collected(cache[0], sorted(cluster_run.recollected), rootdir)
    if collection is not None and not results and failure is None:
        reporter.say("gpusched: no tests collected")
    nodes = {
        agent.name: [card.id for card in agent.info.cards]
        for agent in cluster_run.agents.values()  # with the nodes that joined
    }
    return end_run(
        RunEnd(
            results,
            report.results,
            rootdir,
            report.interrupted,
            report.quarantined,
            failure,
            collected=collection is not None,
            nodes=nodes,
            lost=report.lost,
            coverage=coverage,
        ),
        settings,
        reporter,
    )


async def _collect_and_run(
    paths: Sequence[str],
    args: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    cache: tuple[Path, str] | None,
    history: dict[str, Any],
    run_id: str,
    coverage: Path | None = None,
) -> _Ran:
    """Collection (streaming, from the collection cache where it can) beside the cluster's
    start; then beside the run, which takes each file as soon as both are there.

    Files found while the agents start wait in a ``Backlog``; the collection's
    first event names the rootdir, the directory shipped to the nodes.
    """
    backlog = Backlog()
    if server is not None:
        server.attach()
    try:
        collecting = asyncio.create_task(
            collect_streaming(
                paths,
                [*args, *session.collection_no_cov(coverage is not None)],
                settings["collect_timeout"],
                backlog.on_event,
                server,
                cache,
            )
        )
        try:
            root = await _rootdir(backlog, collecting)
            if root is None:  # the collection failed before it named its rootdir
                exc = collecting.exception()
                assert isinstance(exc, CollectionFailed), exc
                return _Ran(failure=exc)
            config = agent_config(settings, pytest_args, paths, run_id, coverage is not None)
            cluster = await in_thread(
                functools.partial(start_cluster, Path(root), settings, config)
            )
        except BaseException:
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, CollectionFailed):
                await collecting
            raise
        return await _run_cluster(
            cluster, Path(root), collecting, backlog, settings, config, reporter, history, coverage
        )
    finally:
        if server is not None:
            server.detach()


def agent_config(
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    paths: Sequence[str],
    run_id: str,
    coverage: bool = False,
) -> AgentConfig:
    """How every node runs its files; its ``t0`` (now) is when every node's times count from."""
    return AgentConfig(
        run_id=run_id,
        t0=time.time(),
        pytest_args=session.child_args(paths, settings, pytest_args),
        timeout=settings["timeout"],
        kill_grace=settings["kill_grace"],
        reruns=settings["reruns"],
        code_root=settings.get("ray_shared"),
        fork_server=settings.get("fork_server", True),
        preload=tuple(settings.get("preload", ())),
        server_timeout=server_start_timeout(settings["collect_timeout"]),
        gpu_release_timeout=settings["gpu_release_timeout"],
        gpu_release_memory=settings["gpu_release_memory"],
        coverage=coverage,
    )


async def _rootdir(backlog: Backlog, collecting: asyncio.Task[Collection]) -> str | None:
    """The collection's rootdir as soon as it is known; None if the collection failed first."""
    while backlog.rootdir is None and not collecting.done():
        await asyncio.wait({collecting}, timeout=POLL)
    if backlog.rootdir is not None:
        return backlog.rootdir
    try:
        return collecting.result().rootdir
    except CollectionFailed:
        return None


async def _run_cluster(
    cluster: _Cluster,
    root: Path,
    collecting: asyncio.Task[Collection],
    backlog: Backlog,
    settings: dict[str, Any],
    config: AgentConfig,
    reporter: ConsoleReporter,
    history: dict[str, Any],
    coverage: Path | None = None,
) -> _Ran:
    agents = cluster.agents
    for line in describe_holdings(agents):
        reporter.say(line)
    log_dir = STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    live_cards = [Card(f"{a.name}:{card.id}") for a in agents for card in a.info.cards]
    slots = sum(a.cpu_slots for a in agents)
    live = session.live_reporter(reporter, live_cards, slots, 0, collecting=True)
    out = NodeReporter(live or reporter, live is not None)
    cluster_run = ClusterRun(
        agents,
        config,
        {},
        out,
        root=root,
        log_dir=log_dir,
        exitfirst=settings["exitfirst"],
        heartbeat=None if live is not None else settings["heartbeat"],
        cpu_slots=settings["cpu_slots"],
        open_input=True,
        coverage=coverage,
    )
    feeder = Feeder(
        cluster_run,
        cluster_run.refit,
        history,
        out.finished,
        rootdir=str(root),
        grow=live.grow if live is not None else None,
    )

    def collected() -> None:
        if live is not None:
            live.collection_done()
        if feeder.off:
            out.say(f"gpusched: files start once collection is done: {feeder.off}")
        out.say(
            f"gpusched: {len(feeder.jobs)} files on {len(agents)} nodes: "
            + ", ".join(describe_node(agent) for agent in agents)
        )

    feeder.collected = collected
    with live or contextlib.nullcontext():
        running = asyncio.create_task(cluster_run.run([]))
        backlog.open(feeder.on_event)
        collection, failure = await session.run_beside(collecting, running, feeder)
    return _Ran(collection, failure, feeder, cluster_run)


def _cluster_jobs(prepared: session.Prepared, agents: Sequence[Agent]) -> list[Job]:
    nodes = policy_nodes(agents)
    return [
        dataclasses.replace(
            job, requirement=cluster_requirement(entry.requirement, entry.levels, nodes)
        )
        for job, entry in zip(prepared.jobs, prepared.collection.files, strict=True)
    ]


def plan(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
) -> int:
    """``gpusched plan --ray``: the predicted schedule across the cluster's nodes; runs nothing."""
    reporter = reporter or ConsoleReporter()
    check_settings(settings)
    local = {**settings, "simulate_gpus": "0", "gpus": None}
    prepared = session.prepare_plan(paths, local, pytest_args, reporter)
    if isinstance(prepared, int):
        return prepared
    try:
        with ray_messages():
            connect(settings["ray"], None)
            agents = start_agents(settings["cpu_slots"])
    except ClusterError as exc:
        raise UsageError(str(exc)) from None
    jobs = _cluster_jobs(prepared, agents)
    session.say_requirements(reporter, prepared, jobs)
    for line in describe_holdings(agents):
        reporter.say(line)
    runs, skipped = simulate_cluster(policy_nodes(agents), jobs)
    names = {agent.info.node_id: agent.name for agent in agents}
    reporter.say(
        f"\npredicted schedule on {len(agents)} nodes: "
        + ", ".join(describe_node(agent) for agent in agents)
        + ":"
    )
    for planned in sorted(runs, key=lambda r: (r.start, r.job.id)):
        where = format_place(tuple(card.id for card in planned.cards), names[planned.node])
        reporter.say(
            f"  {planned.start:8.1f}s -> {planned.end:8.1f}s  [{where}]  {display_path(planned.job.path)}"
        )
    for job, reason in skipped:
        reporter.say(f"  SKIPPED  {display_path(job.path)} - {reason}")
    makespan = max((r.end for r in runs), default=0.0)
    reporter.say(
        f"gpusched: expected durations of {prepared.known} of {len(jobs)} files "
        f"from {STATE_DIR / HISTORY_FILE}"
        + (", the others get their mean" if prepared.known < len(jobs) else "")
    )
    reporter.say(
        f"gpusched: predicted makespan {makespan:.1f}s for {len(runs)} files on {len(agents)} nodes"
    )
    return EXIT_FAILED if prepared.collection.errors else EXIT_OK
