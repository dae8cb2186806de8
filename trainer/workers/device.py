"""Which device a worker trains on, and which collective backend goes with it.

``trainer.device`` is ``auto``, ``cuda`` or ``cpu``. The decision is a pure
function of the request and what the process can see (:func:`resolve_device`),
so it is tested without a GPU; :func:`worker_device` applies it in a worker.
``CUDA_VISIBLE_DEVICES`` is respected, never rewritten: Ray (and gpusched) set
it to the cards a process was given, so inside a worker the first visible card
is always ``cuda:0``.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cuda", "cpu")

__all__ = ["DEVICES", "backend_for", "resolve_device", "wants_gpu_bundles", "worker_device"]


def resolve_device(requested: str, cuda_available: bool, visible_devices: str | None = None) -> str:
    """``"cuda"`` or ``"cpu"`` for ``trainer.device=requested``.

    ``auto`` picks CUDA when a card is usable. ``cuda`` without one is an error
    that says why: ``CUDA_VISIBLE_DEVICES`` hiding every card (``visible_devices``
    is its value, ``None`` when unset) or no CUDA at all.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device={requested!r}: choose one of {DEVICES}")
    if requested == "cpu":
        return "cpu"
    if cuda_available:
        return "cuda"
    if requested == "auto":
        return "cpu"
    if visible_devices is not None and visible_devices.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={visible_devices!r} hides every GPU"
    else:
        why = "torch.cuda.is_available() is False (no GPU, or a CPU-only torch build)"
    raise RuntimeError(f"trainer.device=cuda: no usable CUDA device: {why}")


def wants_gpu_bundles(requested: str, driver_sees_cuda: bool) -> bool:
    """Whether the driver asks Ray for GPU bundles for ``trainer.device=requested``.

    ``cuda`` always does (the driver itself may have no GPU on a multi-node
    cluster); ``auto`` does when the driver sees CUDA, so ``auto`` on a GPU node
    trains on the GPUs instead of silently placing workers on CPU bundles.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device={requested!r}: choose one of {DEVICES}")
    return requested == "cuda" or (requested == "auto" and driver_sees_cuda)


def backend_for(device_type: str) -> str:
    """The ``torch.distributed`` backend for a device type: NCCL on CUDA, gloo on CPU."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device type {device_type!r}: expected 'cuda' or 'cpu'")
    return "nccl" if device_type == "cuda" else "gloo"


def worker_device(requested: str = "auto") -> torch.device:
    """This process's training device for ``trainer.device=requested`` (the first visible card)."""
    kind = resolve_device(
        requested, torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
