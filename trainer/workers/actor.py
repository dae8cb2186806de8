"""The actor-rollout-reference worker: policy, its optimizer, the rollout engine, the reference.

One instance per data-parallel rank. The driver calls it through a role group:
``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob`` and
``update_actor`` receive this rank's slice of the batch (``DP_SPLIT``); the
first three keep their results in Ray's object store (``resident``), where
the later calls read them (:mod:`trainer.controller.resident`).
With ``actor.strategy=fsdp2`` the policy and reference are sharded with FSDP2
(:mod:`trainer.fsdp`); with ``ddp`` each rank holds them whole and
gradients are all-reduced inside ``update_actor``. Collective methods are
``ONE_TO_ALL`` or ``DP_SPLIT``, so every rank joins.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from trainer import fsdp
from trainer.checkpoints.export import save_hf_model, write_hf_files
from trainer.config import Config
from trainer.controller import Dispatch, DispatchSpec, Worker
from trainer.controller.ledger import move
from trainer.models import load_tokenizer
from trainer.rollout import build_engine, build_rollout
from trainer.workers.compute import compute_log_probs, update_policy
from trainer.workers.device import backend_for, worker_device
from trainer.workers.memory import peak_memory_metrics
from trainer.workers.settings import (
    engine_options,
    policy_settings,
    sampling_params,
    share_prompt,
)
from trainer.workers.setup import build_actor, build_optimizer
from trainer.workers.state import CheckpointSaver, background_save, load_training_state

__all__ = ["ActorRolloutRefWorker", "place_model", "seed_worker", "worker_device"]


def place_model(
    model: torch.nn.Module, device: torch.device, strategy: str, offload: bool = False
) -> torch.nn.Module:
    """Put a freshly loaded model on ``device``: sharded for ``fsdp2``, whole for ``ddp``."""
    if strategy == "fsdp2":
        return fsdp.shard_model(model, device, cpu_offload=offload)
    return model.to(device)


def seed_worker(seed: int, rank: int) -> None:
    """Per-rank seeds, so ranks sample different responses, reproducibly."""
    s = seed * 9973 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


class ActorRolloutRefWorker(Worker):
    """Policy + rollout engine (+ frozen reference policy when a KL term is on)."""

    # The step's batch stays with the workers (resident): the driver reads what its math needs.
    dispatch = {
        "init_model": Dispatch.ONE_TO_ALL,
        "generate_sequences": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "compute_log_prob": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "compute_ref_log_prob": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "update_actor": Dispatch.DP_SPLIT,
        "save_checkpoint": Dispatch.ONE_TO_ALL,
        "wait_checkpoint": Dispatch.ONE_TO_ALL,
        "load_checkpoint": Dispatch.ONE_TO_ALL,
        "state_dict": Dispatch.RANK_ZERO,
        "full_state_dict": Dispatch.ONE_TO_ALL,
        "save_model": Dispatch.ONE_TO_ALL,
    }

    def __init__(self, config: Config, model_path: str, max_new_tokens: int) -> None:
        super().__init__()
        self.cfg = config
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.device = worker_device(config.device_request)
        self.strategy = fsdp.resolve_strategy(config.actor.strategy, self.device.type)
        self.saver: CheckpointSaver | None = None

    def init_model(self) -> None:
        """Join the process group, load policy (and reference), build optimizer and engine."""
        self.init_distributed(backend_for(self.device.type))
        seed_worker(self.cfg.seed, self.rank)
        self.saver = CheckpointSaver("actor", self.rank)
        self.tokenizer = load_tokenizer(self.model_path)
        a = self.cfg.actor
        self.actor = place_model(
            build_actor(self.model_path), self.device, self.strategy, a.offload
        )
        # After sharding: FSDP2's optimizer must see the sharded (DTensor) parameters.
        self.optimizer, self.scheduler = build_optimizer(self.actor, a.optim)
        self.ref = None
        if self.cfg.use_reference:
            ref = build_actor(self.model_path).requires_grad_(False)
            self.ref = place_model(ref, self.device, self.strategy, a.offload).eval()
        self.engine = None
        self.multi_turn = None
        if self.cfg.rollout_pool_workers:  # the rollout pool generates
            return
        self.engine = build_engine(
            self.cfg.rollout.engine,
            self.actor,
            self.tokenizer,
            **engine_options(self.cfg, self.model_path, self.device, self.rank),
        )
        if self.cfg.rollout.multi_turn.enable:  # the episode loop over the same engine
            self.multi_turn = build_rollout(self.cfg, self.engine, self.tokenizer)

    def _gathered(self, model: torch.nn.Module):
        """Full parameters held for a burst of forwards that may differ in count between ranks."""
        return fsdp.gathered_for_inference(model) if fsdp.is_sharded(model) else nullcontext()

    def generate_sequences(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """Sample one response per row of ``prompts`` (rows are already repeated n times)."""
        if self.engine is None:
            raise RuntimeError(
                "this actor has no rollout engine: with rollout.workers or rollout.staleness "
                "set, the rollout pool generates"
            )
        params = sampling_params(self.cfg, self.max_new_tokens, validation=validation)
        # The HF engine runs the training module itself; vLLM holds its own copy.
        shared = self.cfg.rollout.engine == "hf"
        rollout = self.multi_turn or self.engine
        with self._gathered(self.actor) if shared else nullcontext():
            return move(rollout.generate(move(prompts, self.device), params), "cpu")

    def _log_probs(
        self, model: torch.nn.Module, batch: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropy (B, R) of ``model``, on the CPU."""
        with self._gathered(model):
            lp, ent = compute_log_probs(
                model,
                move(batch, self.device),
                self.cfg.rollout.temperature,
                self.cfg.actor.micro_batch_size,
                self.cfg.actor.micro_batch_tokens,
                share_prompt(self.cfg),
            )
        return move(lp, "cpu"), move(ent, "cpu")

    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        """``old_log_probs`` and ``entropy`` (B, R) under the current policy."""
        lp, ent = self._log_probs(self.actor, batch)
        return TensorDict({"old_log_probs": lp, "entropy": ent}, batch_size=batch.batch_size)

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """``ref_log_probs`` (B, R) under the frozen reference policy."""
        if self.ref is None:
            raise RuntimeError(
                "compute_ref_log_prob called but no KL term is configured (no reference model)"
            )
        lp, _ = self._log_probs(self.ref, batch)
        return TensorDict({"ref_log_probs": lp}, batch_size=batch.batch_size)

    def update_actor(self, batch: TensorDict, step: int) -> dict[str, float]:
        """PPO update on this rank's shard (gradients averaged over ranks); returns metrics."""
        metrics = update_policy(
            self.actor, self.optimizer, move(batch, self.device), policy_settings(self.cfg, step)
        )
        self.scheduler.step()
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics.update(peak_memory_metrics(self.device))
        if self.engine is not None:
            self.engine.sync_weights()
        return metrics

    def save_checkpoint(self, directory: str, asynchronous: bool | str = False) -> bool:
        """Write this rank's shard of policy and optimizer, its RNG and the scheduler.

        Rank 0 adds the config and tokenizer (for ``python -m trainer.checkpoints.export``).
        ``asynchronous`` is ``trainer.async_save`` (``auto`` follows this worker's device,
        :func:`background_save`): when it holds, return once staged in host memory and
        :meth:`wait_checkpoint` ends it. Returns whether the write runs in the background.
        """
        self.saver.save(
            directory,
            self.actor,
            self.optimizer,
            self.scheduler,
            asynchronous=background_save(asynchronous, self.device.type),
            extra=lambda role_dir: write_hf_files(role_dir, self.actor, self.tokenizer),
        )
        return self.saver.pending

    def wait_checkpoint(self) -> None:
        """Wait for this rank's background checkpoint write; raise if it failed."""
        self.saver.wait()

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever the saving world size."""
        load_training_state(
            directory, "actor", self.rank, self.actor, self.optimizer, self.scheduler
        )
        if self.engine is not None:
            self.engine.sync_weights()

    def state_dict(self) -> dict[str, Any]:
        """The policy's weights on CPU (from rank 0; ddp only).

        Runs on rank 0 alone, so it cannot gather FSDP2 shards: with
        ``actor.strategy=fsdp2`` use :meth:`full_state_dict` (every rank joins).
        """
        if fsdp.is_sharded(self.actor):
            raise RuntimeError(
                "state_dict runs on rank 0 only and cannot gather the FSDP2 shards of the "
                "policy (actor.strategy=fsdp2); call full_state_dict instead"
            )
        return {k: v.detach().cpu() for k, v in self.actor.state_dict().items()}

    def full_state_dict(self) -> dict[str, Any] | None:
        """The policy's full weights on CPU under HF names on rank 0 (None elsewhere); collective."""
        state = fsdp.full_state_dict(self.actor)
        return state if self.rank == 0 else None

    def save_model(self, directory: str) -> None:
        """Write the policy as a Hugging Face directory (safetensors, config, tokenizer).

        The end-of-run export: every rank joins the gather of the weights (not
        the optimizer) to rank 0, which writes them as the plain model class.
        """
        state = fsdp.full_state_dict(self.actor)
        if self.rank == 0:
            save_hf_model(directory, self.actor.config, state, self.tokenizer)
