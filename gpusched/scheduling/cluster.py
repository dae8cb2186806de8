"""Packing across the nodes of a cluster: the single controller's policy, as pure data.

The driver of a ``gpusched run --ray`` holds one ``ClusterPolicy``: one view of
every node's cards, including nodes that join during the run (``add_node``). It keeps one ``Packer`` per node, so on each node the cards
are chosen exactly as on one machine (best fit on memory, the node's own CPU
budget, quarantine); the policy adds only the choice of the node. Its order is
``order.queue_order``'s: jobs needing a whole node first, then the longest
expected, and on a first run (equal expectations) the width with the most
pending jobs. Each job goes to a node where its CPU use fits beside what runs
there (``Packer.cpu_fits``; it waits for a node whose budget is that large,
unless none is; then it runs alone on any): the one where its cards fit with
the least memory to spare, then the one with the fewest free cards (so large
holes stay open for large jobs); a CPU job
goes to the node with the most free cores. A job never spans nodes: a job
needing more cards than any node has is ``Unschedulable`` with the reason.

A node agent (``gpusched.execution.cluster.agent``) applies the decisions it is
sent through ``PinnedPolicy``, the local runner's policy there: it starts each
job on exactly the cards the driver chose.

Nothing here imports Ray or starts a process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpusched.inventory import Card
from gpusched.requirements import Requirement, format_memory
from gpusched.scheduling.order import queue_order
from gpusched.scheduling.packing import (
    Assignment,
    Decision,
    Job,
    Packer,
    Unschedulable,
    able_cards,
    cpu_demand,
    largest_fitting,
)
from gpusched.scheduling.simulate import replay


@dataclass(frozen=True)
class Node:
    """One node of the cluster as the policy sees it: ``id`` is unique, ``name`` is for people."""

    id: str
    name: str
    cards: tuple[Card, ...]
    cpu_slots: int  # the node's CPU budget, in cores (``packing.cpu_demand``)


@dataclass(frozen=True)
class Placement:
    """Start ``assignment.job`` now on ``node``, on its node-local ``assignment.cards``."""

    node: str
    assignment: Assignment

    @property
    def job(self) -> Job:
        return self.assignment.job

    @property
    def cards(self) -> tuple[Card, ...]:
        return self.assignment.cards


ClusterDecision = Placement | Unschedulable


def _memory_key(card: Card) -> float:
    return math.inf if card.memory is None else card.memory


def cluster_requirement(
    requirement: Requirement, levels: Sequence[Requirement], nodes: Sequence[Node]
) -> Requirement:
    """A file's requirement, lowered to the largest of its tests' levels that fits some node.

    The cluster form of the single-node rule: a file whose maximum fits no node
    still runs at the largest level one node can give it; its tests that need
    more are skipped inside by the plugin.
    """
    if any(largest_fitting((requirement,), node.cards) for node in nodes):
        return requirement
    fitting = [level for node in nodes if (level := largest_fitting(levels, node.cards))]
    return max(fitting, key=lambda level: (level.gpus, level.memory or 0), default=requirement)


class ClusterPolicy:
    """The driver's policy: which node and which of its cards each job gets.

    Called by the cluster driver only. ``complete`` and ``remove_node`` are the
    only ways a job stops holding its cards; the driver calls ``complete`` once
    the node's agent reported the job over (its processes gone, its cards
    checked), and ``remove_node`` when the node left the cluster.
    """

    def __init__(self, nodes: Sequence[Node]) -> None:
        ids = [node.id for node in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node ids must be unique, got {ids}")
        self._nodes: dict[str, Node] = {node.id: node for node in nodes}
        self._packers = {node.id: Packer(node.cards, node.cpu_slots) for node in nodes}
        self._quarantined: dict[str, set[str]] = {node.id: set() for node in nodes}
        self._pending: list[Job] = []
        self._running: dict[int, Placement] = {}

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def running(self) -> dict[int, Placement]:
        return dict(self._running)

    def submit(self, jobs: Iterable[Job]) -> None:
        self._pending.extend(jobs)

    def schedule(self) -> list[ClusterDecision]:
        """Decisions to apply now, in ``queue_order``; the driver reports back through ``complete``."""
        decisions: list[ClusterDecision] = []
        still_pending: list[Job] = []
        whole_node = max((len(self._usable(node_id)) for node_id in self._nodes), default=0)
        for job in queue_order(self._pending, whole_node):
            reason = self._never_fits(job)
            if reason:
                decisions.append(Unschedulable(job, reason))
                continue
            node = self._choose(job)
            if node is None:
                still_pending.append(job)
                continue
            packer = self._packers[node]
            packer.submit([job])
            made: list[Decision] = packer.schedule()
            assert len(made) == 1 and isinstance(made[0], Assignment), made  # it fits: checked
            placement = Placement(node, made[0])
            self._running[job.id] = placement
            decisions.append(placement)
        self._pending = still_pending
        return decisions

    def withdraw(self, job_id: int) -> Job | None:
        """Take a job that has not started out of the queue (collection revised it); None if it
        is not pending (it started, or it is unknown)."""
        for i, job in enumerate(self._pending):
            if job.id == job_id:
                return self._pending.pop(i)
        return None

    def requeue(self, job: Job, quarantined: Iterable[str] = ()) -> None:
        """``job`` (placed, with the requirement its child found instead) ran no test: its
        cards (but the ``quarantined`` ones) and cores are free, and it waits for the next
        ``schedule`` like any pending job, on whichever node fits it now."""
        self.complete(job.id, quarantined)
        self.submit([job])

    def complete(self, job_id: int, quarantined: Iterable[str] = ()) -> None:
        """The job is over on its node: its cards (but the ``quarantined`` ones) and cores are free."""
        placement = self._running.pop(job_id)
        bad = set(quarantined)
        self._quarantined[placement.node] |= bad
        self._packers[placement.node].complete(job_id, bad)

    def add_node(self, node: Node) -> None:
        """A node joined the cluster during the run: it takes jobs from the next ``schedule`` on.

        A job already skipped as ``Unschedulable`` stays skipped: the policy
        does not wait for nodes that might join.
        """
        if node.id in self._nodes:
            raise ValueError(f"node {node.id} ({node.name}) is already in the run")
        self._nodes[node.id] = node
        self._packers[node.id] = Packer(node.cards, node.cpu_slots)
        self._quarantined[node.id] = set()

    def remove_node(self, node_id: str) -> list[Job]:
        """The node left the cluster: forget it; return the jobs that were running there.

        They are not queued again here: the driver decides (once more, or a failure).
        """
        self._nodes.pop(node_id, None)
        self._packers.pop(node_id, None)
        self._quarantined.pop(node_id, None)
        lost = [p.job for p in self._running.values() if p.node == node_id]
        for job in lost:
            del self._running[job.id]
        return sorted(lost, key=lambda job: job.id)

    def cancel_pending(self) -> list[Job]:
        """Drop every job not yet started (interrupt, ``-x``) and return them in file order."""
        dropped, self._pending = self._pending, []
        return sorted(dropped, key=lambda job: job.id)

    # ------------------------------------------------------------------ internals

    def _usable(self, node_id: str) -> list[Card]:
        bad = self._quarantined[node_id]
        return [card for card in self._nodes[node_id].cards if card.id not in bad]

    def _free(self, node_id: str) -> list[Card]:
        busy = {
            card.id
            for placement in self._running.values()
            if placement.node == node_id
            for card in placement.cards
        }
        return [card for card in self._usable(node_id) if card.id not in busy]

    def _choose(self, job: Job) -> str | None:
        """The node to start ``job`` on now, or None if it fits nowhere yet."""
        order = {node_id: i for i, node_id in enumerate(self._nodes)}
        demand = cpu_demand(job, math.inf)
        candidates = [n for n in self._nodes if self._packers[n].budget >= demand] or list(
            self._nodes
        )  # a job more than every node's budget runs alone on any node
        roomy = [node_id for node_id in candidates if self._packers[node_id].cpu_fits(job)]
        if job.gpus == 0:
            free = {node_id: self._packers[node_id].cpu_free for node_id in roomy}
            return min(roomy, key=lambda n: (-free[n], order[n]), default=None)
        best: tuple[float, int, int] | None = None
        chosen = None
        for node_id in roomy:
            memory = job.requirement.memory
            able = [
                card
                for card in self._free(node_id)
                if memory is None or card.memory is None or card.memory >= memory
            ]
            if len(able) < job.gpus:
                continue
            smallest = sorted(able, key=_memory_key)[: job.gpus]
            key = (sum(_memory_key(card) for card in smallest), len(able), order[node_id])
            if best is None or key < best:
                best, chosen = key, node_id
        return chosen

    def _never_fits(self, job: Job) -> str | None:
        if not self._nodes:
            return "no node of the cluster is left"
        if job.gpus == 0:
            return None
        usable = {node_id: self._usable(node_id) for node_id in self._nodes}
        able = {node_id: able_cards(job.requirement, cards) for node_id, cards in usable.items()}
        if any(count >= job.gpus for count in able.values()):
            return None
        return unschedulable_reason(
            job.requirement, {self._nodes[n].name: cards for n, cards in usable.items()}
        )


def unschedulable_reason(requirement: Requirement, nodes: Mapping[str, Sequence[Card]]) -> str:
    """Why no node can run a file that needs ``requirement`` (``nodes``: name -> usable cards)."""
    gpus, memory = requirement.gpus, requirement.memory
    if not any(nodes.values()):
        return f"needs {gpus} GPUs, no node of the cluster has any"
    largest = max(nodes, key=lambda name: len(nodes[name]))
    if memory is None:
        return f"needs {gpus} GPUs, the largest node ({largest}) has {len(nodes[largest])}"
    able = {name: able_cards(requirement, cards) for name, cards in nodes.items()}
    most = max(able, key=lambda name: able[name])
    return (
        f"needs {gpus} GPUs with >= {format_memory(memory)} on one node, "
        f"the most such cards on one node is {able[most]} ({most})"
    )


class PinnedPolicy:
    """The local runner's policy on a node agent: start each job on the cards the driver chose.

    The agent calls ``place`` before it submits a job to its runner. The runner
    submits a job again for a rerun (``--reruns``): it goes back on the same
    cards, which the driver still counts as taken. A job waits while one of its
    cards is still held on this node (never the case when the driver and the
    agent agree; a safety, not a queue).
    """

    def __init__(self) -> None:
        self._cards: dict[int, tuple[Card, ...]] = {}
        self._pending: list[Job] = []
        self._running: dict[int, tuple[Card, ...]] = {}
        self.quarantined: dict[int, tuple[str, ...]] = {}  # job id -> cards its end quarantined

    def place(self, job: Job, cards: Sequence[Card]) -> None:
        self._cards[job.id] = tuple(cards)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def submit(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            if job.id not in self._cards:
                raise KeyError(f"job {job.id} ({job.path}) was submitted but never placed")
            self._pending.append(job)

    def schedule(self) -> list[Decision]:
        busy = {card.id for cards in self._running.values() for card in cards}
        decisions: list[Decision] = []
        waiting: list[Job] = []
        for job in self._pending:
            cards = self._cards[job.id]
            if any(card.id in busy for card in cards):
                waiting.append(job)
                continue
            busy.update(card.id for card in cards)
            self._running[job.id] = cards
            decisions.append(Assignment(job, cards))
        self._pending = waiting
        return decisions

    def complete(self, job_id: int, quarantined: Iterable[str] = ()) -> None:
        self._running.pop(job_id, None)
        self.quarantined[job_id] = tuple(quarantined)

    def cancel_pending(self) -> list[Job]:
        dropped, self._pending = self._pending, []
        return sorted(dropped, key=lambda job: job.id)

    def upcoming(self, count: int) -> list[Job]:
        return []  # the driver decides what comes next; agents start nothing ahead


@dataclass(frozen=True)
class PlacedRun:
    """Where and when a job would run on the cluster, if it took exactly its expected time."""

    node: str
    job: Job
    cards: tuple[Card, ...]
    start: float
    end: float


def simulate_cluster(
    nodes: Sequence[Node], jobs: Sequence[Job]
) -> tuple[list[PlacedRun], list[tuple[Job, str]]]:
    """The runs ``ClusterPolicy`` would make on a virtual clock, and the jobs it would skip.

    The makespan prediction of ``gpusched plan --ray`` is ``max(run.end)``.
    """
    policy = ClusterPolicy(nodes)
    policy.submit(jobs)
    started, skipped = replay(policy)
    runs = [PlacedRun(d.node, d.job, d.cards, start, end) for d, start, end in started]
    return runs, skipped
