"""Broken weight syncs, installed in the trainer's Ray workers by ``TRAINER_EXTRA_WORKER_SETUP_HOOK``.

Each function patches :mod:`trainer.rollout.vllm` in the worker it runs in, so
that ``python -m trainer rollout.engine=vllm`` runs unchanged except for one
realistic bug in how the actor's weights reach the engine. The tests expect
the engine/actor log-prob mismatch metric to catch each one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def skip_push_after_first() -> None:
    """Only the first sync pushes; the engine keeps sampling with the weights of step 1."""
    from trainer.rollout import vllm

    original = vllm.VLLMEngine.sync_weights
    calls = {"n": 0}

    def sync_once(self) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            original(self)

    vllm.VLLMEngine.sync_weights = sync_once


def push_previous_step() -> None:
    """Each sync pushes the weights the previous sync saw: the engine lags one update behind."""
    from trainer.rollout import vllm

    original = vllm._full_tensors
    previous: dict[str, list[tuple[str, torch.Tensor]]] = {}

    def lagging(model, device, dtype) -> Iterator[tuple[str, torch.Tensor]]:
        current = [(name, t.clone()) for name, t in original(model, device, dtype)]
        yield from previous.get("weights", current)
        previous["weights"] = current

    vllm._full_tensors = lagging


def push_to_swapped_names() -> None:
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
