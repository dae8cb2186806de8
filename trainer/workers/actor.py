"""The actor-rollout-reference worker: policy, its optimizer, the rollout engine, the reference.

One instance per data-parallel rank. The driver calls it through a role group:
``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob`` and
``update_actor`` receive this rank's slice of the batch (``DP_SPLIT``) and
gradients are all-reduced over the gloo/NCCL group inside ``update_actor``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from trainer.config import Config
from trainer.controller import Dispatch, Worker
from trainer.models import load_tokenizer
from trainer.rollout import build_engine
from trainer.workers.compute import compute_log_probs, update_policy
from trainer.workers.settings import policy_settings, sampling_params
from trainer.workers.setup import build_actor, build_optimizer
from trainer.workers.state import load_training_state, save_training_state


def worker_device() -> torch.device:
    """The device this process trains on: its CUDA device when there is one, else CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def seed_worker(seed: int, rank: int) -> None:
    """Per-rank seeds, so ranks sample different responses, reproducibly."""
    s = seed * 9973 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


class ActorRolloutRefWorker(Worker):
    """Policy + rollout engine (+ frozen reference policy when a KL term is on)."""

    dispatch = {
        "init_model": Dispatch.ONE_TO_ALL,
        "generate_sequences": Dispatch.DP_SPLIT,
        "compute_log_prob": Dispatch.DP_SPLIT,
        "compute_ref_log_prob": Dispatch.DP_SPLIT,
        "update_actor": Dispatch.DP_SPLIT,
        "save_checkpoint": Dispatch.ONE_TO_ALL,
        "load_checkpoint": Dispatch.ONE_TO_ALL,
        "state_dict": Dispatch.RANK_ZERO,
    }

    def __init__(self, config: Config, model_path: str, max_new_tokens: int) -> None:
        super().__init__()
        self.cfg = config
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.device = worker_device()

    def init_model(self) -> None:
        """Join the process group, load policy (and reference), build optimizer and engine."""
        self.init_distributed()
        seed_worker(self.cfg.seed, self.rank)
        self.tokenizer = load_tokenizer(self.model_path)
        self.actor = build_actor(self.model_path).to(self.device)
        self.optimizer, self.scheduler = build_optimizer(self.actor, self.cfg.actor.optim)
        self.ref = (
            build_actor(self.model_path).to(self.device).eval() if self.cfg.use_reference else None
        )
        self.engine = build_engine(self.cfg.rollout.engine, self.actor, self.tokenizer)

    def generate_sequences(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """Sample one response per row of ``prompts`` (rows are already repeated n times)."""
        params = sampling_params(self.cfg, self.max_new_tokens, validation=validation)
        return self.engine.generate(prompts.to(self.device), params).to("cpu")

    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        """``old_log_probs`` and ``entropy`` (B, R) under the current policy."""
        lp, ent = compute_log_probs(
            self.actor,
            batch.to(self.device),
            self.cfg.rollout.temperature,
            self.cfg.actor.micro_batch_size,
        )
        return TensorDict(
            {"old_log_probs": lp.cpu(), "entropy": ent.cpu()}, batch_size=batch.batch_size
        )

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """``ref_log_probs`` (B, R) under the frozen reference policy."""
        if self.ref is None:
            raise RuntimeError(
                "compute_ref_log_prob called but no KL term is configured (no reference model)"
            )
        lp, _ = compute_log_probs(
            self.ref,
            batch.to(self.device),
            self.cfg.rollout.temperature,
            self.cfg.actor.micro_batch_size,
        )
        return TensorDict({"ref_log_probs": lp.cpu()}, batch_size=batch.batch_size)

    def update_actor(self, batch: TensorDict, step: int) -> dict[str, float]:
        """PPO update on this rank's shard (gradients averaged over ranks); returns metrics."""
        metrics = update_policy(
            self.actor, self.optimizer, batch.to(self.device), policy_settings(self.cfg, step)
        )
        self.scheduler.step()
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        self.engine.sync_weights()
        return metrics

    def save_checkpoint(self, directory: str) -> None:
        """Write policy, optimizer, scheduler (rank 0) and this rank's RNG states."""
        save_training_state(
            directory, "actor", self.rank, self.actor, self.optimizer, self.scheduler
        )

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (each rank its own RNG)."""
        load_training_state(
            directory, "actor", self.rank, self.actor, self.optimizer, self.scheduler
        )
        self.engine.sync_weights()

    def state_dict(self) -> dict[str, Any]:
        """The policy's weights on CPU (from rank 0)."""
        return {k: v.detach().cpu() for k, v in self.actor.state_dict().items()}

    def save_model(self, directory: str) -> None:  # pragma: no cover - used by export
        """Save the policy with ``save_pretrained`` (rank 0 only)."""
        if self.rank == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.actor.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
