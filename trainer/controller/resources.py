"""Resource pools: how many worker processes on how many nodes, and their Ray form.

* :class:`ResourcePool` is a pure description (processes per node, what one
  process needs).
* :func:`check_feasible` is pure logic: given the pools and the nodes' sizes,
  it raises :class:`InfeasibleError` naming the pool, the node sizes and the
  request when the pools cannot be placed, instead of letting Ray wait forever
  for a placement group that can never be scheduled.
* :class:`RayResourcePool` reserves one STRICT_PACK placement group per node
  entry and orders the bundles: rank ``i`` is bundle ``i`` of the pool, with
  placement groups sorted by their node's address so ranks are stable across
  restarts.
* :class:`ResourcePoolManager` maps roles to pools, checks feasibility against
  what Ray reports per node, then reserves every pool.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "InfeasibleError",
    "NodeResources",
    "RayResourcePool",
    "ResourcePool",
    "ResourcePoolManager",
    "check_feasible",
    "order_by_node",
]

_EPS = 1e-6


class InfeasibleError(RuntimeError):
    """The requested pools cannot be placed on the cluster's nodes."""


@dataclass(frozen=True)
class ResourcePool:
    """Worker processes per node, and what each process needs.

    ``processes_per_node=[4, 4]`` asks for two nodes with four processes each;
    each entry becomes one STRICT_PACK placement group (all its bundles on one
    node). With ``use_gpu`` every bundle holds ``gpus_per_process`` GPUs.
    ``num_threads`` is the torch intra-op thread count set in each process.
    """

    processes_per_node: tuple[int, ...]
    use_gpu: bool = False
    cpus_per_process: float = 1.0
    gpus_per_process: float = 1.0
    num_threads: int | None = 1

    def __post_init__(self) -> None:
        counts = tuple(self.processes_per_node)
        object.__setattr__(self, "processes_per_node", counts)
        if not counts or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts
        ):
            raise ValueError(
                f"processes_per_node must be a non-empty list of positive ints, got {list(counts)}"
            )
        if self.cpus_per_process < 0 or (not self.use_gpu and self.cpus_per_process <= 0):
            raise ValueError(
                f"cpus_per_process must be > 0 (>= 0 with use_gpu), got {self.cpus_per_process}"
            )
        if self.use_gpu and self.gpus_per_process <= 0:
            raise ValueError(
                f"gpus_per_process must be > 0 with use_gpu, got {self.gpus_per_process}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")

    @property
    def world_size(self) -> int:
        return sum(self.processes_per_node)

    def bundle(self) -> dict[str, float]:
        """Resources of one process (one placement-group bundle)."""
        out = {"CPU": float(self.cpus_per_process)}
        if self.use_gpu:
            out["GPU"] = float(self.gpus_per_process)
        return {k: v for k, v in out.items() if v > 0}


@dataclass(frozen=True)
class NodeResources:
    """One alive node as Ray reports it: id, address and total resources."""

    node_id: str
    address: str
    resources: Mapping[str, float] = field(default_factory=dict)


def _fmt(resources: Mapping[str, float]) -> str:
    parts = [f"{k}={v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU")]
    return "{" + ", ".join(parts) + "}"


def _times(bundle: Mapping[str, float], n: int) -> dict[str, float]:
    return {k: v * n for k, v in bundle.items()}


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in need.items())


def check_feasible(pools: Mapping[str, ResourcePool], nodes: Sequence[NodeResources]) -> None:
    """Raise :class:`InfeasibleError` unless every pool's groups fit on the nodes.

    Each node entry of a pool must fit on one node (STRICT_PACK). Groups are
    packed largest first onto the node with the least room that still fits;
    the error names the pool, its request and every node's size.
    """
    node_desc = ", ".join(f"{n.address} {_fmt(n.resources)}" for n in nodes) or "none"
    if not nodes:
        raise InfeasibleError("no alive Ray nodes to place resource pools on")
    for name, pool in pools.items():
        for count in pool.processes_per_node:
            need = _times(pool.bundle(), count)
            if not any(_fits(need, n.resources) for n in nodes):
                raise InfeasibleError(
                    f"resource pool {name!r} asks for {count} processes of {_fmt(pool.bundle())} "
                    f"on one node (STRICT_PACK, {_fmt(need)} in all), but no node is that large; "
                    f"nodes: {node_desc}"
                )
    free = [dict(n.resources) for n in nodes]
    groups = sorted(
        (
            (name, count, _times(pool.bundle(), count))
            for name, pool in pools.items()
            for count in pool.processes_per_node
        ),
        key=lambda g: (-g[2].get("GPU", 0.0), -g[2].get("CPU", 0.0)),
    )
    for name, count, need in groups:
        fitting = [i for i, have in enumerate(free) if _fits(need, have)]
        if not fitting:
            request = "; ".join(
                f"{n}: {list(p.processes_per_node)} x {_fmt(p.bundle())}" for n, p in pools.items()
            )
            raise InfeasibleError(
                f"resource pools do not fit together: no room left for {count} processes of "
                f"resource pool {name!r} ({_fmt(need)} on one node); requests: {request}; "
                f"nodes: {node_desc}"
            )
        best = min(fitting, key=lambda i: (free[i].get("GPU", 0.0), free[i].get("CPU", 0.0)))
        for k, v in need.items():
            free[best][k] = free[best].get(k, 0.0) - v


def _address_key(address: str) -> tuple[int, Any]:
    try:
        ip = ipaddress.ip_address(address)
        return (ip.version, int(ip))
    except ValueError:
        return (99, address)


def order_by_node(group_nodes: Sequence[NodeResources]) -> list[int]:
    """Indices of placement groups sorted by their node (address, then id).

    Ties (groups on the same node) keep creation order, so the order depends
    only on which nodes hold the groups.
    """
    return sorted(
        range(len(group_nodes)),
        key=lambda i: (_address_key(group_nodes[i].address), group_nodes[i].node_id, i),
    )


def ray_nodes() -> list[NodeResources]:
    """Alive nodes with their total resources, from ``ray.nodes()``."""
    import ray

    return [
        NodeResources(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]


class RayResourcePool:
    """A :class:`ResourcePool` reserved on Ray: one STRICT_PACK placement group per node entry.

    Built by :meth:`ResourcePoolManager.reserve`. ``bundles()`` gives
    ``(placement_group, bundle_index)`` per rank; rank ``i`` is bundle ``i``.
    """

    def __init__(self, name: str, pool: ResourcePool, timeout_s: float = 60.0) -> None:
        import ray
        from ray.util.placement_group import (
            placement_group,
            placement_group_table,
            remove_placement_group,
        )

        self.name = name
        self.pool = pool
        groups = [
            placement_group([pool.bundle()] * count, strategy="STRICT_PACK", name="")
            for count in pool.processes_per_node
        ]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) != len(groups):
            for g in groups:
                remove_placement_group(g)
            raise InfeasibleError(
                f"resource pool {name!r}: placement groups {list(pool.processes_per_node)} x "
                f"{_fmt(pool.bundle())} not ready after {timeout_s:g} s (resources taken by "
                f"something else?); nodes: "
                + ", ".join(f"{n.address} {_fmt(n.resources)}" for n in ray_nodes())
            )
        by_id = {n.node_id: n for n in ray_nodes()}
        nodes = [by_id[placement_group_table(g)["bundles_to_node_id"][0]] for g in groups]
        order = order_by_node(nodes)
        self._groups = [groups[i] for i in order]
        self.nodes = [nodes[i] for i in order]

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def bundles(self) -> list[tuple[Any, int]]:
        """``(placement_group, bundle_index)`` for ranks ``0 .. world_size - 1``."""
        return [(g, i) for g in self._groups for i in range(g.bundle_count)]

    def rank_nodes(self) -> list[NodeResources]:
        """The node of each rank, ``0 .. world_size - 1``."""
        return [
            n for g, n in zip(self._groups, self.nodes, strict=True) for _ in range(g.bundle_count)
        ]

    def release(self) -> None:
        """Remove the placement groups (kills actors still placed in them)."""

        from ray.util.placement_group import remove_placement_group

        for g in self._groups:
            remove_placement_group(g)
        self._groups = []
        self.nodes = []


class ResourcePoolManager:
    """Maps roles to named pools; checks and reserves them on Ray.

    ``ResourcePoolManager({"train": ResourcePool([2])}, {"actor": "train",
    "critic": "train"})`` colocates actor and critic in the same two
    processes. Roles mapped to different pools get different processes.
    """

    def __init__(self, pools: Mapping[str, ResourcePool], roles: Mapping[str, str]) -> None:
        for name, pool in pools.items():
            if not isinstance(pool, ResourcePool):
                raise TypeError(f"pool {name!r} must be a ResourcePool, got {type(pool).__name__}")
        unknown = {role: pool for role, pool in roles.items() if pool not in pools}
        if unknown:
            raise ValueError(f"roles mapped to undefined pools: {unknown}; pools: {sorted(pools)}")
        self.pools = dict(pools)
        self.roles = dict(roles)
        self._reserved: dict[str, RayResourcePool] = {}

    def pool_of(self, role: str) -> str:
        """Name of the pool ``role`` runs on."""
        if role not in self.roles:
            raise KeyError(f"role {role!r} is not mapped to a pool; roles: {sorted(self.roles)}")
        return self.roles[role]

    def check(self, nodes: Sequence[NodeResources] | None = None) -> None:
        """Feasibility of the used pools on ``nodes`` (default: Ray's alive nodes)."""
        used = {name: self.pools[name] for name in dict.fromkeys(self.roles.values())}
        check_feasible(used, ray_nodes() if nodes is None else nodes)

    def reserve(self, timeout_s: float = 60.0) -> dict[str, RayResourcePool]:
        """Check feasibility, then reserve every used pool (idempotent)."""
        if not self._reserved:
            self.check()
            try:
                for name in dict.fromkeys(self.roles.values()):
                    self._reserved[name] = RayResourcePool(name, self.pools[name], timeout_s)
            except BaseException:
                self.release()
                raise
        return dict(self._reserved)

    def release(self) -> None:
        """Remove every reserved placement group."""
        for reserved in self._reserved.values():
            reserved.release()
        self._reserved = {}
