"""The order in which the cluster policy offers its pending jobs to the nodes: pure.

``queue_order`` sorts a queue once per ``ClusterPolicy.schedule`` call; the
policy then starts every job, in that order, that fits some node now:

1. GPU jobs that need a whole node (as many cards as the widest node has)
   first. They start only on a drained node; at the start every node is
   drained, while later one must be emptied for them, its other cards idle.
2. Then the longest expected first, whatever the width.
3. Among equal expectations (every file of a first run: the history knows
   none, so each expects the same), the width with the most pending jobs
   first, then the wider, then file order. Each pending job is then one unit
   of the same expected work; serving the longest queue keeps the widths'
   queues even, so no width is left at the end with a queue that runs one
   file after another (largest-first sends every narrow file last).
4. CPU jobs after GPU jobs (they take CPU slots, never cards): longest
   expected first, then file order.

Measured on a virtual clock by ``bench/cluster_virtual.py`` (3 nodes x 4
cards, 500 random suites per family): against the earlier order (most GPUs,
then longest expected), rule 1 with 2 lowers the mean makespan with history
and rule 1 with 3 the mean without, in every family there.

The single-node ``Packer`` keeps its own order (most GPUs first).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpusched.scheduling.packing import Job


def queue_order(jobs: Iterable[Job], whole_node: int) -> list[Job]:
    """``jobs`` in the order to offer them; ``whole_node``: the most cards one node has."""
    queue = list(jobs)
    pending = Counter(job.gpus for job in queue)

    def key(job: Job) -> tuple[bool, bool, float, int, int, int]:
        return (
            job.gpus == 0,
            job.gpus != whole_node,
            -job.expected,
            -pending[job.gpus],
            -job.gpus,
            job.id,
        )

    return sorted(queue, key=key)
