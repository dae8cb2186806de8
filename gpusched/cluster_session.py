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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpusched import EXIT_FAILED, EXIT_OK, EXIT_USAGE, STATE_DIR, session
from gpusched.atomic import atomic_write
from gpusched.collection.collect import CollectionFailed
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
    start_agents,
)
from gpusched.execution.cluster.reach import parse_address
from gpusched.execution.forkclient import EarlyServer, new_run_id
from gpusched.history import HISTORY_FILE, observations, record_durations
from gpusched.inventory import Card
from gpusched.options import UsageError
from gpusched.reporting.report import ConsoleReporter, display_path, format_place
from gpusched.results import FileResult
from gpusched.scheduling.cluster import cluster_requirement, simulate_cluster
from gpusched.scheduling.packing import Job

RAY_LOG = "ray.log"  # under .gpusched/logs: what Ray itself printed on the driver


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

    def say(self, line: str) -> None:
        self.inner.say(line)


def _collect(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    early: EarlyServer | None,
    run_id: str,
) -> session.Prepared:
    """Collection on the driver, as on one machine but without local cards.

    The collection cache is off: its predictions are checked by each file's
    child on one machine, which a cluster run does not do yet.
    """
    local = {**settings, "simulate_gpus": "0", "gpus": None, "collect_cache": False}
    with session.fork_server(paths, local, run_id, reporter, early) as server:
        return session.prepare(paths, local, pytest_args, server)


def _cluster_jobs(prepared: session.Prepared, agents: Sequence[Agent]) -> list[Job]:
    nodes = policy_nodes(agents)
    return [
        dataclasses.replace(
            job, requirement=cluster_requirement(entry.requirement, entry.levels, nodes)
        )
        for job, entry in zip(prepared.jobs, prepared.collection.files, strict=True)
    ]


def run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
    early: EarlyServer | None = None,
) -> int:
    """``gpusched run --ray``: collect here, run across the cluster, report here. The exit code."""
    reporter = reporter or ConsoleReporter()
    check_settings(settings)
    session.check_per_test_timeout(settings)
    run_id = early.spec.run_id if early is not None else new_run_id()
    try:
        prepared = _collect(paths, settings, pytest_args, reporter, early, run_id)
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted during collection")
        return session.finish([], True, [], settings, reporter)
    except CollectionFailed as exc:
        if exc.exit_code == EXIT_USAGE:
            raise UsageError(str(exc)) from None
        reporter.say(f"gpusched: {exc}")
        return exc.exit_code
    for warning in prepared.warnings:
        reporter.say(f"gpusched: warning: {warning}")
    results = session.collection_results(prepared.collection)
    for result in results:
        reporter.finished(result)
    if not prepared.jobs:
        if not results:
            reporter.say("gpusched: no tests collected")
        return session.finish(results, False, [], settings, reporter)
    root = Path(prepared.collection.rootdir)
    try:
        with ray_messages():
            return _run_on_cluster(
                prepared, root, run_id, settings, paths, pytest_args, reporter, results
            )
    except ClusterError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted while starting the node agents")
        return session.finish(results, True, [], settings, reporter)


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


def _run_on_cluster(
    prepared: session.Prepared,
    root: Path,
    run_id: str,
    settings: dict[str, Any],
    paths: Sequence[str],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    results: list[FileResult],
) -> int:
    shared = settings.get("ray_shared")
    connect(settings["ray"], CodeSpec(root, shared, tuple(settings.get("ray_excludes", ()))))
    agents = start_agents(settings["cpu_slots"])
    check_versions(agents)
    jobs = _cluster_jobs(prepared, agents)
    reporter.say(
        f"gpusched: {len(jobs)} files on {len(agents)} nodes: "
        + ", ".join(describe_node(agent) for agent in agents)
    )
    for line in describe_holdings(agents):
        reporter.say(line)
    log_dir = STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(
        run_id=run_id,
        t0=time.time(),
        pytest_args=session.child_args(paths, settings, pytest_args),
        timeout=settings["timeout"],
        kill_grace=settings["kill_grace"],
        reruns=settings["reruns"],
        code_root=shared,
        fork_server=settings.get("fork_server", True),
        preload=tuple(settings.get("preload", ())),
        server_timeout=settings["collect_timeout"],
        gpu_release_timeout=settings["gpu_release_timeout"],
        gpu_release_memory=settings["gpu_release_memory"],
    )
    tests = {entry.path: entry.tests for entry in prepared.collection.files}
    live_cards = [Card(f"{a.name}:{card.id}") for a in agents for card in a.info.cards]
    live = session.live_reporter(reporter, live_cards, sum(a.cpu_slots for a in agents), len(jobs))
    cluster_run = ClusterRun(
        agents,
        config,
        tests,
        NodeReporter(live or reporter, live is not None),
        root=root,
        log_dir=log_dir,
        exitfirst=settings["exitfirst"],
        heartbeat=None if live is not None else settings["heartbeat"],
        cpu_slots=settings["cpu_slots"],
    )
    with live or contextlib.nullcontext():
        report = asyncio.run(cluster_run.run(jobs))
    disconnect()  # the agents are done: nothing from Ray after the summary
    warning = record_durations(
        STATE_DIR / HISTORY_FILE, observations(report.results, prepared.collection.rootdir)
    )
    if warning:
        reporter.say(f"gpusched: warning: {warning}")
    if settings.get("timeline"):
        from gpusched.reporting.timeline import timeline_html

        nodes = {
            agent.name: [card.id for card in agent.info.cards]
            for agent in cluster_run.agents.values()  # with the nodes that joined
        }
        atomic_write(settings["timeline"], timeline_html(results + report.results, nodes=nodes))
    for name, why in report.lost:
        reporter.say(f"gpusched: node {name} was lost: {why}")
    return session.finish(
        results + report.results, report.interrupted, report.quarantined, settings, reporter
    )


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
