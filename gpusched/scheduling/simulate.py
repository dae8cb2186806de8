"""Replay a policy on a virtual clock: the predicted schedule of ``gpusched plan``."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from gpusched.inventory import Card
from gpusched.scheduling.packing import Assignment, Job, Packer


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
    now = 0.0
    runs: list[PlannedRun] = []
    skipped: list[tuple[Job, str]] = []
    finishing: list[tuple[float, int]] = []
    while True:
        for decision in packer.schedule():
            if isinstance(decision, Assignment):
                end = now + decision.job.expected
                runs.append(PlannedRun(decision.job, decision.cards, now, end))
                heapq.heappush(finishing, (end, decision.job.id))
            else:
                skipped.append((decision.job, decision.reason))
        if not finishing:
            break
        now, job_id = heapq.heappop(finishing)
        packer.complete(job_id)
        while finishing and finishing[0][0] == now:
            packer.complete(heapq.heappop(finishing)[1])
    return runs, skipped
