"""The decisions behind a streaming ``--ray`` run, without Ray: the backlog that holds what the
collection found while the cluster starts, the feeder driving the cluster run's driver, and a
file whose child found it needs other cards (placed again, on whichever node fits it now).

The driver (``ClusterRun``) is built on fake agents whose actors record what they were sent;
its event loop is not started: each step calls the handler the loop would call.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpusched.collection.collect import CollectedFile, Collection
from gpusched.collection.stream import FileFound, Rooted, StreamOff
from gpusched.execution.cluster.agent import (
    AgentConfig,
    FileFinished,
    FileRequeued,
    FileStarted,
    NodeInfo,
    Placed,
)
from gpusched.execution.cluster.driver import Agent, ClusterRun
from gpusched.feed import Backlog, Feeder
from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.results import FileResult, Outcome, expectation
from gpusched.scheduling.cluster import ClusterPolicy, Node, Placement
from gpusched.scheduling.packing import Job


class _Method:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))


class FakeActor:
    """An agent's actor that records each call the driver makes on it."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.calls, name)

    def placed(self) -> list[Placed]:
        return [item for name, args in self.calls if name == "place" for item in args[0]]


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.results: list[FileResult] = []
        self.joins: list[tuple[str, tuple[str, ...], int]] = []

    def started(self, job, node, cards, attempt) -> None:
        pass

    def finished(self, result: FileResult) -> None:
        self.results.append(result)

    def interrupting(self, signum, second) -> None:
        pass

    def heartbeat(self, running) -> None:
        pass

    def joined(self, node, cards, cpu_slots) -> None:
        self.joins.append((node, cards, cpu_slots))

    def say(self, line: str) -> None:
        self.lines.append(line)


def agent(node_id: str, cards: int) -> Agent:
    info = NodeInfo(node_id, node_id, tuple(Card(str(i)) for i in range(cards)), True, 2, {}, 1)
    return Agent(info, node_id, FakeActor(), 1)


def cluster_run(tmp_path: Path, *agents: Agent) -> tuple[ClusterRun, Recorder]:
    config = AgentConfig("r", time.time(), (), None, 1.0, 0, None, False, (), 10.0, 1.0, 0)
    reporter = Recorder()
    run = ClusterRun(agents, config, {}, reporter, root=tmp_path, log_dir=tmp_path, open_input=True)
    return run, reporter


def found(tmp_path: Path, name: str, gpus: int, cached: bool = True) -> CollectedFile:
    path = str(tmp_path / name)
    return CollectedFile(path, Requirement(gpus), (f"{name}::test",), (Requirement(gpus),), cached)


def test_the_backlog_holds_events_until_the_cluster_is_up_then_passes_them_on_in_order():
    backlog = Backlog()
    first, second = FileFound(found(Path("/r"), "a.py", 0)), FileFound(found(Path("/r"), "b.py", 1))
    for event in (Rooted("/r"), first, second):
        backlog.on_event(event)
    assert backlog.rootdir == "/r"  # known before the cluster: it is what the nodes get
    heard: list = []
    backlog.open(heard.append)
    assert heard == [Rooted("/r"), first, second]
    backlog.on_event(StreamOff("why"))
    assert heard[-1] == StreamOff("why") and not backlog.held


def test_a_requeued_job_frees_its_cards_and_goes_where_it_fits_now():
    policy = ClusterPolicy(
        [Node("small", "small", (Card("0"),), 1), Node("big", "big", (Card("0"), Card("1")), 1)]
    )
    policy.submit([Job(0, "test_b.py", Requirement(1), 1.0)])
    (placement,) = policy.schedule()
    assert isinstance(placement, Placement) and placement.node == "small"  # best fit
    policy.requeue(Job(0, "test_b.py", Requirement(2), 1.0))
    (again,) = policy.schedule()
    assert again.node == "big" and len(again.cards) == 2
    assert not policy.has_pending and list(policy.running) == [0]


def test_withdraw_takes_only_a_pending_job():
    policy = ClusterPolicy([Node("n", "n", (Card("0"),), 1)])
    policy.submit([Job(0, "a.py", Requirement(1), 1.0), Job(1, "b.py", Requirement(1), 1.0)])
    policy.schedule()  # job 0 runs, job 1 waits for the card
    assert policy.withdraw(0) is None
    assert policy.withdraw(1) == Job(1, "b.py", Requirement(1), 1.0)
    assert not policy.has_pending


def test_files_stream_into_the_cluster_run_with_the_caches_prediction(tmp_path):
    small, big = agent("small", 1), agent("big", 2)
    run, _ = cluster_run(tmp_path, small, big)
    feeder = Feeder(run, run.refit, {}, lambda result: None, rootdir=str(tmp_path))
    feeder.on_event(FileFound(found(tmp_path, "test_a.py", 1)))
    run._place()  # what the loop does on the next event
    (placed,) = small.actor.placed()
    assert placed.path == "test_a.py" and placed.cards == ("0",)
    assert placed.expect == expectation(Requirement(1), ("test_a.py::test",))
    # A file found later is placed at the next decision, while collection still runs.
    feeder.on_event(FileFound(found(tmp_path, "test_c.py", 2, cached=False)))
    run._place()
    (later,) = big.actor.placed()
    assert later.path == "test_c.py" and later.cards == ("0", "1")
    assert later.expect == expectation(Requirement(2), ("test_c.py::test",))  # streamed: checked
    assert run.input_open and not run.stopping


def test_a_file_its_child_found_larger_is_placed_again_and_forgotten_by_the_cache(tmp_path):
    small, big = agent("small", 1), agent("big", 2)
    run, reporter = cluster_run(tmp_path, small, big)
    run.submit([Job(0, str(tmp_path / "test_b.py"), Requirement(1), 1.0)], {}, {})
    run._place()
    run._heard("small", [FileStarted(0, ("0",), 1)])
    run._heard("small", [FileRequeued(0, Requirement(2), (Requirement(2),), ("test_b.py::t",))])
    (line,) = reporter.lines
    assert line.endswith(
        "test_b.py needs 2 GPUs, not the 1 GPU the collection cache predicted: queued again"
    )
    run._place()
    (again,) = big.actor.placed()
    assert again.cards == ("0", "1") and again.expect is None  # its own collection is the truth
    assert again.tests == ("test_b.py::t",)
    assert run.recollected == {str(tmp_path / "test_b.py")}
    assert not reporter.results  # it ran no test: no result until it really runs


def test_a_requeue_while_stopping_is_not_run(tmp_path):
    node = agent("n", 2)
    run, reporter = cluster_run(tmp_path, node)
    run.submit([Job(0, str(tmp_path / "test_b.py"), Requirement(1), 1.0)], {}, {})
    run._place()
    run.stop("collection failed")
    run._heard("n", [FileRequeued(0, Requirement(2), (Requirement(2),), ("test_b.py::t",))])
    (result,) = reporter.results
    assert result.outcome == Outcome.NOT_RUN and result.message == "not started (collection failed)"
    assert not run.policy.running and not run.policy.has_pending


def test_a_pending_file_is_revised_by_the_final_collection_a_started_one_is_not(tmp_path):
    node = agent("n", 1)
    run, _ = cluster_run(tmp_path, node)
    feeder = Feeder(run, run.refit, {}, lambda result: None, rootdir=str(tmp_path))
    a, b = found(tmp_path, "test_a.py", 1), found(tmp_path, "test_b.py", 1)
    feeder.on_event(FileFound(a))
    feeder.on_event(FileFound(b))
    run._place()  # test_a takes the one card; test_b waits
    final_b = CollectedFile(b.path, Requirement(0), b.tests, (Requirement(0),), True)
    final_a = CollectedFile(a.path, Requirement(0), a.tests, (Requirement(0),), True)
    feeder.finish(Collection(str(tmp_path), [final_a, final_b], [], []))
    assert run.jobs[1].requirement == Requirement(0)  # revised before it started
    assert run.jobs[0].requirement == Requirement(1)  # started: its child checks
    run._heard("n", [FileFinished(0, FileResult(a.path, Outcome.PASSED), True, (), None, True)])
    assert run.recollected == {a.path}


def test_a_node_that_joins_is_told_to_the_reporter_with_its_idle_cards(tmp_path):
    run, reporter = cluster_run(tmp_path, agent("n", 1))

    async def join() -> None:
        run._joined(agent("late", 2))
        for task in run.tasks:
            task.cancel()  # its poller: no actor to poll here

    asyncio.run(join())
    assert reporter.joins == [("late", ("0", "1"), 1)]
    assert any(node.id == "late" for node in run.policy.nodes)
