"""Broken weight syncs, and the check on the mismatch metric that must catch them.

Each fault patches :mod:`trainer.rollout.vllm` in the process it runs in (a
trainer's Ray worker, through ``TRAINER_EXTRA_WORKER_SETUP_HOOK``, or a test's
rank) so that the engine runs unchanged except for one realistic bug in how
the actor's weights reach it, and returns a function that undoes the patch.
:func:`assert_in_sync` is the check a run with the real sync passes and a run
with any of these faults fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

IN_SYNC = 1e-3
"""Bound on the mean |p_actor - p_vllm| over sampled tokens, float32 on both sides."""
MAX_LOGP_GAP = 1e-3
"""Bound on the largest |log p_actor - log p_vllm| of a step: in sync it is about 1e-6."""

FAULTS = ("skip_push_after_first", "push_previous_step", "push_to_swapped_names")
"""The faults :func:`assert_in_sync` catches (``skip_prefix_cache_reset`` shows elsewhere)."""


def assert_in_sync(rows: list[dict]) -> None:
    """The engine sampled with the actor's weights at every step (rows: per-step metrics).

    The mean catches a stale engine; the max also catches a bug that moves a
    few tokens a lot and most hardly at all (a tensor loaded under a wrong name).
    """
    means = [r["rollout/actor_prob_diff_mean"] for r in rows]
    maxes = [r["rollout/actor_logprob_diff_max"] for r in rows]
    assert all(g < IN_SYNC for g in means), f"mean |p_actor - p_vllm| per step: {means}"
    assert all(g < MAX_LOGP_GAP for g in maxes), f"max |log-prob gap| per step: {maxes}"


def skip_push_after_first() -> Callable[[], None]:
    """Only the first sync pushes; the engine keeps sampling with the weights of step 1."""
    from trainer.rollout import vllm

    original = vllm.VLLMEngine.sync_weights
    calls = {"n": 0}

    def sync_once(self) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            original(self)

    vllm.VLLMEngine.sync_weights = sync_once
    return lambda: setattr(vllm.VLLMEngine, "sync_weights", original)


def push_previous_step() -> Callable[[], None]:
    """Each sync pushes the weights the previous sync saw: the engine lags one update behind."""
    from trainer.rollout import vllm

    original = vllm._full_tensors
    previous: dict[str, list[tuple[str, torch.Tensor]]] = {}

    def lagging(model, device, dtype) -> Iterator[tuple[str, torch.Tensor]]:
        current = [(name, t.clone()) for name, t in original(model, device, dtype)]
        yield from previous.get("weights", current)
        previous["weights"] = current

    vllm._full_tensors = lagging
    return lambda: setattr(vllm, "_full_tensors", original)


def push_to_swapped_names() -> Callable[[], None]:
    """The gate and up projections of layer 0 (same shape) are pushed under each other's name."""
    from trainer.rollout import vllm

    original = vllm.weights_for_vllm
    swap = {
        "model.layers.0.mlp.gate_proj.weight": "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight": "model.layers.0.mlp.gate_proj.weight",
    }

    def swapped(named, tie_word_embeddings) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in original(named, tie_word_embeddings):
            yield swap.get(name, name), t

    vllm.weights_for_vllm = swapped
    return lambda: setattr(vllm, "weights_for_vllm", original)


def skip_prefix_cache_reset() -> Callable[[], None]:
    """The push reloads the weights but vLLM's prefix cache is not dropped (and says nothing).

    On CPU with the tiny model no cached prefix is ever reused (vLLM's CPU blocks
    hold 128 tokens, the prompts fewer), so the samples do not change: the
    rollout worker's acknowledgement (``async/prefix_cache_reset``) is what shows it.
    """
    from vllm import LLM

    original = LLM.reset_prefix_cache
    LLM.reset_prefix_cache = lambda self, *args, **kwargs: None
    return lambda: setattr(LLM, "reset_prefix_cache", original)
