"""The FSDP2 training engine: sharding a Hugging Face model over a device mesh.

``actor.strategy`` / ``critic.strategy`` pick how a worker's model is kept in
sync across data-parallel ranks:

- ``fsdp2``: :func:`shard_model` applies ``torch.distributed.fsdp.fully_shard``
  to every decoder layer and then to the root, over a 1-D mesh of all ranks.
  Parameters, gradients and optimizer state are sharded; gradients are
  reduce-scattered (averaged) in backward. On CUDA it computes in bf16 with
  fp32 master weights, fp32 gradient reduction and an fp32 optimizer; on CPU
  (gloo) it runs the same wrapping in fp32, which is what CI exercises.
- ``ddp``: every rank holds the whole model and gradients are all-reduced by
  :func:`trainer.workers.compute.allreduce_gradients` (one flat all-reduce).
- ``auto``: ``fsdp2`` on CUDA, ``ddp`` on CPU (the tiny CPU model gains nothing
  from sharding; ``bench/ppo_step.py --strategy`` measures both).

Pure choices (:func:`resolve_strategy`, :func:`decoder_layers`,
:func:`mixed_precision_policy`) are separate from the collective operations
(:func:`shard_model`, :func:`full_state_dict`, :func:`load_full_state_dict`,
:func:`gathered_for_inference`) so they can be tested without a process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

STRATEGIES = ("auto", "fsdp2", "ddp")

__all__ = [
    "STRATEGIES",
    "decoder_layers",
    "full_optimizer_state_dict",
    "full_state_dict",
    "gathered_for_inference",
    "is_sharded",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "mixed_precision_policy",
    "resolve_strategy",
    "shard_model",
]


def resolve_strategy(strategy: str, device_type: str, key: str = "actor.strategy") -> str:
    """``fsdp2`` or ``ddp`` for ``strategy`` on ``device_type`` (``auto``: fsdp2 on CUDA only).

    ``key`` names the configuration entry in the error for a bad value.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"{key}={strategy!r}: choose one of {STRATEGIES}")
    if strategy == "auto":
        return "fsdp2" if device_type == "cuda" else "ddp"
    return strategy


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: instances of the classes in HF's ``_no_split_modules``.

    Hugging Face models list there the block classes that must stay whole
    (``LlamaDecoderLayer``, ...), which is exactly the unit to shard one by one.
    Raises ``ValueError`` naming the model class when none is found, rather than
    silently sharding the whole model as one unit.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    # Match through the MRO: fully_shard subclasses each module (FSDPLlamaDecoderLayer).
    layers = [
        m
        for m in model.modules()
        if m is not model and any(c.__name__ in names for c in type(m).__mro__)
    ]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found to shard (its _no_split_modules "
            f"is {sorted(names) or 'empty'}); FSDP2 wrapping needs a Hugging Face model "
            "that lists its block classes there"
        )
    return layers


def mixed_precision_policy(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on CUDA; ``None`` (all fp32) elsewhere.

    The parameters themselves (and so the optimizer) stay fp32: FSDP2 casts the
    all-gathered copy to ``param_dtype`` for compute only.
    """
    if device_type != "cuda":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(
    model: torch.nn.Module,
    device: torch.device,
    *,
    mixed_precision: bool = True,
    cpu_offload: bool = False,
) -> torch.nn.Module:
    """Apply ``fully_shard`` to each decoder layer, then the root, over all ranks.

    Must be called on every rank of the initialised default process group, with
    the same (identically initialised) model; the model may still be on CPU and
    is moved to ``device`` shard by shard. ``cpu_offload`` keeps the sharded
    parameters, gradients and optimizer state in host memory (FSDP2's
    ``CPUOffloadPolicy``) so an idle role holds no accelerator memory; it is
    only meaningful on CUDA. Returns the same module, now an ``FSDPModule``.
    """
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised torch.distributed process group")
    if cpu_offload and device.type != "cuda":
        raise ValueError(f"cpu_offload=True needs a CUDA device, got {device}")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    policy = mixed_precision_policy(device.type) if mixed_precision else None
    if policy is not None:
        kwargs["mp_policy"] = policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    else:
        model.to(device)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model wrapped by :func:`shard_model`."""
    return isinstance(model, FSDPModule)


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_for_inference(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Keep an FSDP2 model's full parameters gathered for the duration (a no-op otherwise).

    Each FSDP2 forward all-gathers its parameters, so every rank must run the
    same number of forwards. Generation (which stops when this rank's samples
    end) and micro-batched scoring of uneven shards do not: inside this context
    the parameters are all-gathered once up front and no forward communicates.
    Every rank must enter it (the up-front gather is a collective).
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield model
        return
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    handles = [m.unshard(async_op=True) for m in modules]
    for h in handles:
        if h is not None:
            h.wait()
    try:
        yield model
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU under plain HF names: on rank 0, ``{}`` on the others.

    A collective for FSDP2 models (every rank calls it). Loads into a plain
    ``from_pretrained`` model with ``load_state_dict``.
    """
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into a sharded or plain model; every rank calls it."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer state unsharded on CPU, keyed by parameter name, on rank 0 (collective)."""
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load what :func:`full_optimizer_state_dict` returned; every rank calls it."""
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
