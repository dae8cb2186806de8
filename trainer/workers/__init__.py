"""The trainer's Ray workers: actor-rollout-reference and critic.

Each worker holds one data-parallel shard's share of the work; the math is in
:mod:`trainer.workers.compute` so the single-process reference loop runs the
same code.
"""

from trainer.workers.actor import ActorRolloutRefWorker
from trainer.workers.critic import CriticWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker"]
