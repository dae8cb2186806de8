"""What Ray granted this process: the source of truth for a worker's device.

A worker trains on a GPU, and joins its group over NCCL, only when Ray gave it
GPU ids. CUDA being visible is not enough: on a GPU node a worker whose bundle
asked for no GPU still sees the cards (Ray leaves ``CUDA_VISIBLE_DEVICES``
alone for it), and picking NCCL there breaks the group the moment a CPU
tensor meets a collective.
"""

from __future__ import annotations

__all__ = ["granted_backend", "granted_gpu_ids", "in_ray_actor"]


def in_ray_actor() -> bool:
    """True inside a Ray actor process (where Ray's grant decides the device)."""
    import sys

    if "ray" not in sys.modules:  # never import Ray just to find it was not in use
        return False
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def granted_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned this actor (maybe empty); ``None`` outside a Ray actor."""
    if not in_ray_actor():
        return None
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    return [str(i) for i in ids]


def granted_backend() -> str | None:
    """NCCL when Ray granted this actor GPU ids, gloo when none; ``None`` outside Ray."""
    ids = granted_gpu_ids()
    if ids is None:
        return None
    return "nccl" if ids else "gloo"
