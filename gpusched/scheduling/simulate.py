"""Replay a policy on a virtual clock: the predicted schedule of ``gpusched plan``."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.inventory import Card
from gpusched.scheduling.packing import Job, Packer, Unschedulable


@dataclass(frozen=True)
class PlannedRun:
    """Where and when a job would run, if every job took exactly its expected time."""

    job: Job
    cards: tuple[Card, ...]
    start: float
    end: float


def simulate(
    cards: Sequence[Card], jobs: Sequence[Job], cpu_slots: int
) -> tuple[list[PlannedRun], list[tuple[Job, str]]]:
    """The runs the default packer would make, and the jobs it would skip with their reasons.

    Also the makespan predictor: ``max(run.end)`` over the runs.
    """
    packer = Packer(cards, cpu_slots)
    packer.submit(jobs)
    started, skipped = replay(packer)
    return [PlannedRun(d.job, d.cards, start, end) for d, start, end in started], skipped


def replay(policy: Any) -> tuple[list[tuple[Any, float, float]], list[tuple[Job, str]]]:
    """Run ``policy`` (its jobs already submitted) on a virtual clock where every job takes
    exactly its expected time: each decision that started a job with its start and end,
    and the jobs it skipped with their reasons. Any policy with ``schedule`` and
    ``complete`` whose decisions carry ``job`` (the one node's, the cluster's)."""
    now = 0.0
    started: list[tuple[Any, float, float]] = []
    skipped: list[tuple[Job, str]] = []
    finishing: list[tuple[float, int]] = []
    while True:
        for decision in policy.schedule():
            if isinstance(decision, Unschedulable):
                skipped.append((decision.job, decision.reason))
                continue
            end = now + decision.job.expected
            started.append((decision, now, end))
            heapq.heappush(finishing, (end, decision.job.id))
        if not finishing:
            break
        now, job_id = heapq.heappop(finishing)
        policy.complete(job_id)
        while finishing and finishing[0][0] == now:
            policy.complete(heapq.heappop(finishing)[1])
    return started, skipped
