"""How the roles mapped to one pool share its bundles: which worker processes to start.

Pure logic, no Ray. :func:`~trainer.controller.group.create_role_groups`
asks :func:`plan_hosts` for the :class:`HostSet` list and starts one
``WorkerHost`` per bundle of each set, asking Ray for the set's
``num_cpus`` and ``num_gpus``.

* ``"process"``: one host per bundle holds the whole bundle and every role of
  the pool (one process, one device, one ``torch.distributed`` group).
* ``"actor"``: each of the ``k`` roles of a pool gets its own host per bundle
  asking for ``1/k`` of the bundle, so rank ``i`` of every role shares bundle
  ``i``'s card from a process of its own (what verl users know as fractional
  GPU shares for colocated roles).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from trainer.controller.resources import ResourcePool

__all__ = ["COLOCATE_MODES", "ColocateMode", "HostSet", "plan_hosts"]

ColocateMode = Literal["process", "actor"]
COLOCATE_MODES: tuple[ColocateMode, ...] = ("process", "actor")

# Ray keeps resource quantities in units of 1/10000.
_RESOURCE_UNIT = 10_000


@dataclass(frozen=True)
class HostSet:
    """One worker process per bundle of ``pool``, hosting ``roles``.

    Each process asks Ray for ``num_cpus`` and ``num_gpus`` inside its bundle.
    """

    pool: str
    roles: tuple[str, ...]
    num_cpus: float
    num_gpus: float


def _share(amount: float, k: int) -> float:
    """``amount / k`` rounded down to Ray's resource unit, so ``k`` shares always fit."""
    return math.floor(amount * _RESOURCE_UNIT / k) / _RESOURCE_UNIT


def plan_hosts(
    role_pools: Mapping[str, str], pools: Mapping[str, ResourcePool], colocate: str
) -> list[HostSet]:
    """The host sets for ``role_pools`` (role -> pool name, in construction order).

    Raises ``ValueError`` naming ``colocate`` when it is not one of
    :data:`COLOCATE_MODES`, or when ``"actor"`` would give a role a GPU share
    above one card that is not a whole number of cards (Ray gives a process
    either a fraction of one card or whole cards).
    """
    if colocate not in COLOCATE_MODES:
        raise ValueError(f"colocate must be one of {list(COLOCATE_MODES)}, got {colocate!r}")
    by_pool: dict[str, list[str]] = {}
    for role, pool in role_pools.items():
        by_pool.setdefault(pool, []).append(role)
    out = []
    for name, roles in by_pool.items():
        bundle = pools[name].bundle()
        groups = [tuple(roles)] if colocate == "process" else [(role,) for role in roles]
        k = len(groups)
        cpus, gpus = _share(bundle.get("CPU", 0.0), k), _share(bundle.get("GPU", 0.0), k)
        if gpus > 1 and not gpus.is_integer():
            raise ValueError(
                f"colocate='actor' splits each bundle of pool {name!r} ({bundle.get('GPU'):g} GPUs) "
                f"among its {k} roles: {gpus:g} GPUs each, but a share above one card must be a "
                "whole number of cards; make gpus_per_process a multiple of the role count, or "
                "use colocate='process'"
            )
        out.extend(HostSet(name, group, cpus, gpus) for group in groups)
    return out
