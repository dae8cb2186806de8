"""Greedy packing of test files onto cards and cores: largest first, best fit on memory.

Whenever cards or cores free up, the policy starts the largest pending job that
fits (most GPUs, then longest expected duration, then file order) on the free
cards with the least sufficient memory, and repeats until nothing fits. A job
also needs room for its CPU use in the node's CPU budget (``cpu_slots`` cores),
GPU jobs included: ``cpu_demand`` says how many cores it counts, ``cpu_fits``
when that is room enough (the summed demands kept nearest the budget). A job that can
never fit is handed back as ``Unschedulable`` with the reason instead of being
waited for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpusched.inventory import Card
from gpusched.requirements import Requirement, format_memory

# What a job counts against the CPU budget, in cores (see ``cpu_demand``).
UNMEASURED_CPU_FILE = 1.0  # a CPU file never measured: one core, what one pytest process takes
UNMEASURED_GPU_FILE = 0.0  # a GPU file never measured: its cards bound it, as before measuring
MIN_CPU = 0.1  # a measured file counts at least this much: at most 10 files per core
_EPSILON = 1e-9  # demands are summed as floats: ten files of 0.1 must fit in one core


@dataclass(frozen=True)
class Job:
    """One test file to run. ``id`` is its position in file order; ``expected`` is in seconds.

    ``cpu``: the cores its process tree used on average when it ran (from the
    durations history); None if it was never measured.
    """

    id: int
    path: str
    requirement: Requirement
    expected: float = 1.0
    cpu: float | None = None

    @property
    def gpus(self) -> int:
        return self.requirement.gpus


def cpu_demand(job: Job, budget: float) -> float:
    """The cores ``job`` counts against a node's CPU budget while it runs.

    Its measured mean use, at least ``MIN_CPU``; a job never measured counts
    ``UNMEASURED_CPU_FILE`` (no GPU) or ``UNMEASURED_GPU_FILE`` (GPUs), so a
    first run packs as gpusched did before it measured anything. Never more
    than ``budget``: a file that alone needs more than the node has still
    runs, alone.
    """
    if job.cpu is None:
        demand = UNMEASURED_GPU_FILE if job.gpus else UNMEASURED_CPU_FILE
    else:
        demand = max(MIN_CPU, job.cpu)
    return min(demand, budget)


@dataclass(frozen=True)
class Assignment:
    """Start ``job`` now on ``cards`` (empty for a CPU job); it holds its ``cpu_demand`` too."""

    job: Job
    cards: tuple[Card, ...]


@dataclass(frozen=True)
class Unschedulable:
    """``job`` can never run on this inventory; report it as skipped with ``reason``."""

    job: Job
    reason: str


Decision = Assignment | Unschedulable


class Policy(Protocol):
    """What the runner needs from a scheduling policy."""

    def submit(self, jobs: Iterable[Job]) -> None: ...

    def schedule(self) -> list[Decision]: ...

    def complete(self, job_id: int, quarantined: Iterable[str] = ()) -> None: ...

    def cancel_pending(self) -> list[Job]: ...

    def upcoming(self, count: int) -> list[Job]: ...

    def adopt(self, job: Job) -> Assignment:
        """Count a job that already runs outside the runner (an early start) as running."""
        ...

    def withdraw(self, job_id: int) -> Job | None:
        """Take a pending job out of the queue (collection revised it); None if not pending."""
        ...

    def release_cpu(self, count: int = 1) -> None:
        """Give back cores held for early starts that will not be adopted, or for the collection."""
        ...

    @property
    def has_pending(self) -> bool: ...


def _priority(job: Job) -> tuple[int, float, int]:
    return (-job.gpus, -job.expected, job.id)


def _fits(card: Card, memory: int | None) -> bool:
    # A card of unknown memory (simulated without sizes) satisfies any minimum.
    return memory is None or card.memory is None or card.memory >= memory


def able_cards(requirement: Requirement, cards: Iterable[Card]) -> int:
    """How many of ``cards`` have enough memory for ``requirement``."""
    return sum(1 for card in cards if _fits(card, requirement.memory))


def largest_fitting(levels: Iterable[Requirement], cards: Sequence[Card]) -> Requirement | None:
    """The largest of a file's test requirements that this inventory can ever satisfy.

    A file whose maximum does not fit still runs at this level: its tests that
    need more are skipped inside by the plugin (``needs N GPUs, M visible``),
    as plain pytest would, instead of the whole file being skipped.
    """
    fitting = [
        level for level in levels if level.gpus == 0 or able_cards(level, cards) >= level.gpus
    ]
    return max(fitting, key=lambda level: (level.gpus, level.memory or 0), default=None)


class Packer:
    """The default policy. Called by the runner only; every method is O(jobs x cards).

    ``cpu_slots`` is the node's CPU budget in cores: the jobs running at once
    count about that much (``cpu_demand``; over by less than the cores a job
    would otherwise leave idle, see ``cpu_fits``), a job needing all of it alone.
    """

    def __init__(self, cards: Sequence[Card], cpu_slots: int) -> None:
        if cpu_slots < 1:
            raise ValueError(f"cpu_slots must be at least 1, got {cpu_slots}")
        self._order = {card.id: i for i, card in enumerate(cards)}
        self._usable: dict[str, Card] = {card.id: card for card in cards}
        self._free: dict[str, Card] = dict(self._usable)
        self._budget = float(cpu_slots)
        self._reserved = 0  # cores of early starts not adopted yet, and of the collection
        self._pending: list[Job] = []
        self._running: dict[int, Assignment] = {}
        self._demand: dict[int, float] = {}  # running job id -> the cores it counts

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def running(self) -> dict[int, Assignment]:
        return dict(self._running)

    @property
    def budget(self) -> float:
        """The node's CPU budget in cores."""
        return self._budget

    @property
    def cpu_free(self) -> float:
        """Cores of the budget that no running job or reservation counts now."""
        return self._budget - self._reserved - sum(self._demand.values())

    def cpu_fits(self, job: Job) -> bool:
        """Whether starting ``job`` now keeps the node's expected load nearest its budget.

        Demands are averages, so a rule of "only what fits in the free cores"
        leaves a fraction of a core idle beside every running file, for as long
        as the next file in line is a little larger than that fraction. A job
        therefore starts when its demand fits in the free cores, or when
        starting it brings the summed demands closer to the budget than
        leaving those cores idle: over by less than the free cores left
        (demand < 2 x free). A job that counts the whole budget still waits
        for an empty node, and one counting nothing (a GPU file never measured)
        is bound by its cards only.
        """
        demand = cpu_demand(job, self._budget)
        free = self.cpu_free
        if demand >= self._budget - _EPSILON:
            return free >= self._budget - _EPSILON
        return demand <= max(free, 0.0) + _EPSILON or demand < 2 * free

    def submit(self, jobs: Iterable[Job]) -> None:
        self._pending.extend(jobs)
        self._pending.sort(key=_priority)

    def schedule(self) -> list[Decision]:
        """Decisions to apply now; the runner reports back through ``complete``."""
        decisions: list[Decision] = []
        still_pending: list[Job] = []
        for job in self._pending:
            reason = self._never_fits(job)
            if reason:
                decisions.append(Unschedulable(job, reason))
                continue
            cards = self._best_fit(job) if self.cpu_fits(job) else None
            if cards is None:
                still_pending.append(job)
                continue
            decisions.append(self._hold(Assignment(job, cards)))
        self._pending = still_pending
        return decisions

    def complete(self, job_id: int, quarantined: Iterable[str] = ()) -> None:
        """Called by the runner once no process of the job remains: its cards and cores are free.

        Cards in ``quarantined`` did not come back (memory still held) and are
        never handed out again in this run.
        """
        assignment = self._running.pop(job_id)
        del self._demand[job_id]
        bad = set(quarantined)
        for card_id in bad:
            self._usable.pop(card_id, None)
        for card in assignment.cards:
            if card.id not in bad:
                self._free[card.id] = card

    def reserve_cpu(self, count: int) -> None:
        """Hold ``count`` cores for files already running outside the policy (early starts)."""
        self._reserved += count

    def release_cpu(self, count: int = 1) -> None:
        """Give back reserved cores (an early start never adopted, the collection done)."""
        self._reserved -= min(count, self._reserved)

    def adopt(self, job: Job) -> Assignment:
        """Count a CPU job that already runs (on a reserved core) as running; ``complete`` frees it.

        From then on it counts its own ``cpu_demand`` instead of the reserved core.
        """
        if job.gpus or not self._reserved:
            raise ValueError(f"job {job.id} ({job.path}): only a CPU job on a reserved slot")
        self._reserved -= 1
        return self._hold(Assignment(job, ()))

    def _hold(self, assignment: Assignment) -> Assignment:
        """Count ``assignment``'s cards and cores as taken until ``complete``."""
        job = assignment.job
        for card in assignment.cards:
            del self._free[card.id]
        self._running[job.id] = assignment
        self._demand[job.id] = cpu_demand(job, self._budget)
        return assignment

    def withdraw(self, job_id: int) -> Job | None:
        """Take a job that has not started out of the queue; None if it is not pending."""
        for i, job in enumerate(self._pending):
            if job.id == job_id:
                return self._pending.pop(i)
        return None

    def upcoming(self, count: int) -> list[Job]:
        """Up to ``count`` pending GPU jobs likely to start next (the runner warm-starts them).

        When cards free up, the job that gets them is the head of the queue of
        some GPU count (the first fitting job in priority order). So the heads
        of every count's queue come first, largest count first, then the
        second of each, and so on. CPU jobs are left out: they wait for cores,
        which a warm start would only take from the files running on them.
        """
        queues: dict[int, list[Job]] = {}
        for job in self._pending:  # priority order: more GPUs first
            queue = queues.setdefault(job.gpus, [])
            if job.gpus and len(queue) < count and self._never_fits(job) is None:
                queue.append(job)
        picked: list[Job] = []
        for rank in range(count):
            for queue in queues.values():
                if rank < len(queue) and len(picked) < count:
                    picked.append(queue[rank])
        return picked

    def cancel_pending(self) -> list[Job]:
        """Drop every job not yet started (interrupt, ``-x``) and return them in file order."""
        dropped, self._pending = self._pending, []
        return sorted(dropped, key=lambda job: job.id)

    def _never_fits(self, job: Job) -> str | None:
        if job.gpus == 0:
            return None
        memory = job.requirement.memory
        able = able_cards(job.requirement, self._usable.values())
        if able >= job.gpus:
            return None
        if memory is None or able == len(self._usable):
            return f"needs {job.gpus} GPUs, {len(self._usable)} available"
        return (
            f"needs {job.gpus} GPUs with >= {format_memory(memory)}, "
            f"{able} of {len(self._usable)} cards have that much"
        )

    def _best_fit(self, job: Job) -> tuple[Card, ...] | None:
        if job.gpus == 0:
            return ()
        memory = job.requirement.memory
        candidates = [card for card in self._free.values() if _fits(card, memory)]
        if len(candidates) < job.gpus:
            return None
        candidates.sort(
            key=lambda card: (
                math.inf if card.memory is None else card.memory,
                self._order[card.id],
            )
        )
        return tuple(sorted(candidates[: job.gpus], key=lambda card: self._order[card.id]))
