"""The rollout worker: an engine and its own copy of the policy, on a pool of its own.

With ``rollout.workers >= 1`` (or ``rollout.staleness >= 1``) generation leaves
the actor's processes: each rank of the rollout pool holds a plain (unsharded)
copy of the policy, a rollout engine over it (``hf`` or ``vllm``) and, for
multi-turn, the episode loop. The driver pushes the actor's weights after each
update (:meth:`RolloutWorker.load_weights`), stamped with the policy version;
every batch comes back stamped with the version that generated it, the engine's
log-prob of each sampled token (the behaviour policy of the corrected loss)
and the seed of the rank that sampled it.

Ray runs one call at a time per worker, in the order the driver submitted
them, so a push submitted after a generation never changes the weights under
it, and a generation submitted after a push always sees the new weights.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
from tensordict import TensorDict

from trainer.config import Config
from trainer.controller import Dispatch, DispatchSpec, Worker
from trainer.controller.ledger import move
from trainer.models import load_tokenizer
from trainer.rollout import build_engine, build_rollout
from trainer.workers.actor import seed_worker
from trainer.workers.compute import compute_log_probs
from trainer.workers.device import backend_for, worker_device
from trainer.workers.settings import engine_options, sampling_params, share_prompt
from trainer.workers.setup import build_actor

__all__ = ["RolloutWorker", "weights_fingerprint"]


def weights_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, dtype, shape and bytes in ``state``.

    Equal weights give equal fingerprints exactly; a push that did not land, or
    landed the previous version's weights, gives a different one. It reads each
    tensor's bytes once, without a float copy, so it is cheap at every push on
    both sides.
    """
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    return digest.hexdigest()


class RolloutWorker(Worker):
    """One rank of the rollout pool: generates batches from pushed weights."""

    dispatch = {
        "init_model": Dispatch.ONE_TO_ALL,
        "load_weights": Dispatch.ONE_TO_ALL,
        "load_weights_async": DispatchSpec(Dispatch.ONE_TO_ALL, blocking=False),
        # Batches stay in the object store until the actor's workers read them.
        "generate_sequences": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "generate_async": DispatchSpec(Dispatch.DP_SPLIT, blocking=False, resident=True),
    }

    def __init__(self, config: Config, model_path: str, max_new_tokens: int) -> None:
        super().__init__()
        self.cfg = config
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.device = worker_device(config.device_request)
        self.version = -1
        """The policy version of the weights the engine holds; -1 until the first push."""

    def init_model(self) -> None:
        """Join the pool's process group, load the policy copy and build the engine."""
        self.init_distributed(backend_for(self.device.type))
        self.seed = self.cfg.seed * 9973 + self.rank
        seed_worker(self.cfg.seed, self.rank)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = build_actor(self.model_path).to(self.device).eval().requires_grad_(False)
        self.engine = build_engine(
            self.cfg.rollout.engine,
            self.model,
            self.tokenizer,
            **engine_options(self.cfg, self.model_path, self.device, self.rank),
        )
        self.multi_turn = None
        if self.cfg.rollout.multi_turn.enable:
            self.multi_turn = build_rollout(self.cfg, self.engine, self.tokenizer)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Take the actor's weights as policy ``version``; the acknowledgement says what landed.

        The engine is re-synced from the copy (vLLM: weights reloaded and its
        prefix cache reset, so no cached prompt keeps keys and values of the
        old weights). Returns the version, the fingerprint of the weights now
        held and the seconds it took.
        """
        t0 = time.perf_counter()
        self._load(state)
        self.version = int(version)
        held = self.model.state_dict()
        return {
            "version": self.version,
            "fingerprint": weights_fingerprint({name: held[name] for name in state}),
            "seconds": time.perf_counter() - t0,
            # Engines without a prefix cache (hf) have nothing to reset.
            "prefix_cache_reset": bool(getattr(self.engine, "prefix_cache_reset", True)),
        }

    def load_weights_async(self, state: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """:meth:`load_weights`, called without waiting: the driver checks the acknowledgement later."""
        return self.load_weights(state, version)

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
        self.engine.sync_weights()

    def generate_sequences(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """Sample one response per row; adds the engine's log-probs and the batch's stamps.

        ``rollout_log_probs`` (B, R): the engine's log-prob of each sampled token
        (vLLM's own; for ``hf`` this worker's forward over the copy that
        sampled, at the training temperature). ``policy_version`` (B,) and
        ``rollout_seed`` (B,): the weights and the rank's seed behind each row.
        """
        if self.version < 0:
            raise RuntimeError(
                "rollout worker asked to generate before any weights were pushed (load_weights)"
            )
        params = sampling_params(self.cfg, self.max_new_tokens, validation=validation)
        t0 = time.perf_counter()
        rollout = self.multi_turn or self.engine
        out = rollout.generate(move(prompts, self.device), params)
        if not validation and "rollout_log_probs" not in out.keys():
            lp, _ = compute_log_probs(
                self.model,
                out,
                self.cfg.rollout.temperature,
                self.cfg.actor.micro_batch_size,
                self.cfg.actor.micro_batch_tokens,
                share_prompt(self.cfg),
            )
            out["rollout_log_probs"] = lp * out["response_mask"]
        b = out.batch_size[0]
        out["policy_version"] = torch.full((b,), self.version, dtype=torch.long, device=self.device)
        out["rollout_seed"] = torch.full((b,), self.seed, dtype=torch.long, device=self.device)
        out["rollout_seconds"] = torch.full(
            (b,), time.perf_counter() - t0, dtype=torch.float64, device=self.device
        )
        return move(out, "cpu")

    def generate_async(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """:meth:`generate_sequences`, called without waiting: the driver holds a pending call."""
        return self.generate_sequences(prompts, validation)
