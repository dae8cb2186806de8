"""Which device the trainer uses, and which collective backend goes with it.

Devices follow what Ray granted, never ``torch.cuda.is_available()`` alone:

- the driver: ``trainer.device=auto`` means CUDA when the Ray cluster it runs
  on offers GPUs and CPU when it offers none (:func:`plan_devices`, a pure
  function of the request and the cluster's resources);
- a worker: CUDA and NCCL when Ray assigned it GPU ids, CPU and gloo when it
  assigned none (:func:`resolve_device`, a pure function of the request and
  the grant; outside Ray, of what CUDA shows).

``CUDA_VISIBLE_DEVICES`` is respected, never rewritten: Ray (and gpusched) set
it to the cards a process was given, so inside a worker the first visible card
is always ``cuda:0``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.controller.grant import granted_gpu_ids
from trainer.placement import CPU_WORKERS

DEVICES = ("auto", "cuda", "cpu")

__all__ = [
    "CPU_WORKERS",
    "DEVICES",
    "DevicePlan",
    "backend_for",
    "plan_devices",
    "resolve_device",
    "worker_device",
]


@dataclass(frozen=True)
class DevicePlan:
    """What the driver asks Ray for: the device kind and how many workers."""

    device: str
    num_workers: int

    @property
    def use_gpu(self) -> bool:
        return self.device == "cuda"


def plan_devices(
    requested: str, cluster_gpus: float, num_workers: int, pools: int = 1
) -> DevicePlan:
    """The device and worker count for ``trainer.device=requested`` on a cluster.

    ``cluster_gpus`` is what the Ray cluster offers (``ray.cluster_resources()``),
    ``num_workers`` the user's ``trainer.num_workers`` (0: auto) and ``pools``
    how many pools of that size the run reserves (2 when the critic has its
    own). ``auto`` trains on CUDA exactly when the cluster has GPUs; on CUDA,
    auto workers are as many as the GPUs allow, on CPU :data:`CPU_WORKERS`.
    Asking for more GPU workers than the cluster has is an error that says so.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device={requested!r}: choose one of {DEVICES}")
    if num_workers < 0:
        raise ValueError(f"trainer.num_workers={num_workers}: must be >= 0 (0 means auto)")
    gpus = int(cluster_gpus)
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return DevicePlan("cpu", num_workers or CPU_WORKERS)
    if gpus == 0:
        raise RuntimeError(
            "trainer.device=cuda: the Ray cluster offers no GPU (Ray detected none on its "
            "nodes: check CUDA_VISIBLE_DEVICES and the driver, or start Ray with --num-gpus)"
        )
    fits = gpus // pools
    if fits == 0:
        raise RuntimeError(
            f"trainer.device={requested}: {pools} pools need at least {pools} GPUs, "
            f"the Ray cluster offers {gpus}"
        )
    if num_workers > fits:
        per = f" per pool ({pools} pools)" if pools > 1 else ""
        raise RuntimeError(
            f"trainer.num_workers={num_workers}: the Ray cluster offers {gpus} GPU(s), room for "
            f"{fits} GPU worker(s){per}; lower trainer.num_workers or use trainer.device=cpu"
        )
    return DevicePlan("cuda", num_workers or fits)


def resolve_device(
    requested: str,
    cuda_available: bool,
    visible_devices: str | None = None,
    granted_gpus: list[str] | None = None,
) -> str:
    """``"cuda"`` or ``"cpu"`` for a process asked for ``trainer.device=requested``.

    In a Ray actor ``granted_gpus`` is the list of GPU ids Ray assigned it and
    decides alone: ids mean CUDA, none means CPU (``cuda`` with none is an
    error). Outside Ray (``None``), ``auto`` picks CUDA when a card is usable.
    ``cuda`` without one is an error that says why: ``CUDA_VISIBLE_DEVICES``
    (``visible_devices``, ``None`` when unset) hiding every card, or no CUDA.
    """
    if requested not in DEVICES:
        raise ValueError(f"trainer.device={requested!r}: choose one of {DEVICES}")
    if requested == "cpu":
        return "cpu"
    if granted_gpus is not None:
        if not granted_gpus:
            if requested == "cuda":
                raise RuntimeError(
                    "trainer.device=cuda: Ray granted this worker no GPU (its bundle asks for "
                    "none); the driver must reserve GPU bundles (trainer.device=cuda does)"
                )
            return "cpu"
        if not cuda_available:
            raise RuntimeError(
                f"Ray granted this worker GPU(s) {granted_gpus} but torch sees no usable CUDA "
                f"(CUDA_VISIBLE_DEVICES={visible_devices!r}; a CPU-only torch build?)"
            )
        return "cuda"
    if cuda_available:
        return "cuda"
    if requested == "auto":
        return "cpu"
    if visible_devices is not None and visible_devices.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={visible_devices!r} hides every GPU"
    else:
        why = "torch.cuda.is_available() is False (no GPU, or a CPU-only torch build)"
    raise RuntimeError(f"trainer.device=cuda: no usable CUDA device: {why}")


def backend_for(device_type: str) -> str:
    """The ``torch.distributed`` backend for a device type: NCCL on CUDA, gloo on CPU."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device type {device_type!r}: expected 'cuda' or 'cpu'")
    return "nccl" if device_type == "cuda" else "gloo"


def worker_device(requested: str = "auto") -> torch.device:
    """This process's training device for ``trainer.device=requested`` (the first visible card)."""
    kind = resolve_device(
        requested,
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        granted_gpu_ids(),
    )
    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
