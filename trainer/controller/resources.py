"""Resource pools: how many worker processes on how many nodes, and their Ray form.

* :class:`ResourcePool` is a pure description (processes per node, what one
  process needs).
* :func:`check_feasible` is pure logic: given the pools and the nodes' sizes,
  it raises :class:`InfeasibleError` naming the pool, the node sizes and the
  request when the pools cannot be placed, instead of letting Ray wait forever
  for a placement group that can never be scheduled.
* :class:`RayResourcePool` reserves one STRICT_PACK placement group per node
  entry, each on a node that no other entry of the pool uses (Ray enforces it
  through a label selector on the built-in ``ray.io/node-id`` label), and
  orders the bundles: rank ``i`` is bundle ``i`` of the pool, with placement
  groups sorted by their node's address so ranks are stable across restarts.
* :class:`ResourcePoolManager` maps roles to pools, checks feasibility against
  what Ray reports per node, then reserves every pool.
"""

from __future__ import annotations

import ipaddress
import time
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
    node), and the entries of one pool go to distinct nodes (never eight
    processes on one node). With ``use_gpu`` every bundle holds
    ``gpus_per_process`` GPUs.
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


@dataclass(frozen=True)
class _Unplaced:
    """A placement group :func:`_pack` found no node for."""

    pool: str
    count: int
    need: Mapping[str, float]
    own_node_in_the_way: bool
    """A node had room, but another entry of the same pool already holds it."""


def _pack(pools: Mapping[str, ResourcePool], nodes: Sequence[NodeResources]) -> list[_Unplaced]:
    """Pack every node entry of ``pools`` onto ``nodes``; return those that found no node.

    Largest groups (GPUs, then CPUs) go first, each onto the node with the
    least room that still fits it and that no other entry of its pool holds.
    Groups that do not fit are skipped and packing goes on, so the result
    lists every group left over, not only the first.
    """
    free = [dict(n.resources) for n in nodes]
    taken: dict[str, set[int]] = {name: set() for name in pools}
    groups = sorted(
        (
            (name, count, _times(pool.bundle(), count))
            for name, pool in pools.items()
            for count in pool.processes_per_node
        ),
        key=lambda g: (-g[2].get("GPU", 0.0), -g[2].get("CPU", 0.0)),
    )
    unplaced = []
    for name, count, need in groups:
        fitting = [i for i, have in enumerate(free) if _fits(need, have)]
        allowed = [i for i in fitting if i not in taken[name]]
        if not allowed:
            unplaced.append(_Unplaced(name, count, need, bool(fitting)))
            continue
        best = min(allowed, key=lambda i: (free[i].get("GPU", 0.0), free[i].get("CPU", 0.0)))
        taken[name].add(best)
        for k, v in need.items():
            free[best][k] = free[best].get(k, 0.0) - v
    return unplaced


def check_feasible(pools: Mapping[str, ResourcePool], nodes: Sequence[NodeResources]) -> None:
    """Raise :class:`InfeasibleError` unless every pool's groups fit on the nodes.

    Each node entry of a pool must fit on one node (STRICT_PACK), and the
    entries of one pool need distinct nodes: ``[2, 2]`` is two processes on
    each of two nodes, never four on one (:class:`RayResourcePool` enforces the
    same). Each pool is checked alone first, then all pools together, packed
    as :func:`_pack` says; the error names the pool, its request and every
    node's size.
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
        unplaced = _pack({name: pool}, nodes)
        if unplaced:
            entries = len(pool.processes_per_node)
            raise InfeasibleError(
                f"resource pool {name!r} asks for processes_per_node "
                f"{list(pool.processes_per_node)} of {_fmt(pool.bundle())}: its {entries} entries "
                f"need distinct nodes (one STRICT_PACK group per node, never two on one node), "
                f"but only {entries - len(unplaced)} of them fit on distinct nodes; "
                f"nodes: {node_desc}"
            )
    unplaced = _pack(pools, nodes)
    if unplaced:
        first = unplaced[0]
        request = "; ".join(
            f"{n}: {list(p.processes_per_node)} x {_fmt(p.bundle())}" for n, p in pools.items()
        )
        where = (
            "on one node that no other entry of the pool holds"
            if first.own_node_in_the_way
            else "on one node"
        )
        raise InfeasibleError(
            f"resource pools do not fit together: no room left for {first.count} processes of "
            f"resource pool {first.pool!r} ({_fmt(first.need)} {where}); requests: {request}; "
            f"nodes: {node_desc}"
        )


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


# Ray's built-in label: every node carries its own id under this key (Ray >= 2.49).
_NODE_ID_LABEL = "ray.io/node-id"


def _avoiding(node_ids: Sequence[str], count: int) -> list[dict[str, str]] | None:
    """A ``bundle_label_selector`` for ``count`` bundles: any node but ``node_ids``."""
    if not node_ids:
        return None
    return [{_NODE_ID_LABEL: f"!in({','.join(node_ids)})"}] * count


class RayResourcePool:
    """A :class:`ResourcePool` reserved on Ray: one STRICT_PACK placement group per node entry.

    Built by :meth:`ResourcePoolManager.reserve`. The entries go to distinct
    nodes, and Ray itself enforces it: the groups are reserved one after the
    other, largest first, and each carries a label selector on Ray's built-in
    ``ray.io/node-id`` label that excludes the nodes the earlier groups got
    (node addresses cannot tell nodes apart: nodes of one host share it).
    Largest first because a node with room for a large entry has room for a
    smaller one, so an early choice never takes the only node a later entry
    could use. ``bundles()`` gives ``(placement_group, bundle_index)`` per
    rank; rank ``i`` is bundle ``i``.
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
        counts = pool.processes_per_node
        groups: list[Any] = [None] * len(counts)
        node_ids: list[str] = [""] * len(counts)
        deadline = time.monotonic() + timeout_s
        try:
            for i in sorted(range(len(counts)), key=lambda i: -counts[i]):
                taken = [n for n in node_ids if n]
                groups[i] = placement_group(
                    [pool.bundle()] * counts[i],
                    strategy="STRICT_PACK",
                    bundle_label_selector=_avoiding(taken, counts[i]),
                )
                wait_s = max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait([groups[i].ready()], timeout=wait_s)
                if not ready:
                    elsewhere = " on a node the pool's other entries do not use" if taken else ""
                    raise InfeasibleError(
                        f"resource pool {name!r}: placement groups {list(counts)} x "
                        f"{_fmt(pool.bundle())} not ready after {timeout_s:g} s (no room for the "
                        f"group of {counts[i]}{elsewhere}: resources taken by something else?); "
                        "nodes: "
                        + ", ".join(f"{n.address} {_fmt(n.resources)}" for n in ray_nodes())
                    )
                node_ids[i] = placement_group_table(groups[i])["bundles_to_node_id"][0]
        except BaseException:
            for g in groups:
                if g is not None:
                    remove_placement_group(g)
            raise
        by_id = {n.node_id: n for n in ray_nodes()}
        nodes = [by_id[node_id] for node_id in node_ids]
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
    "critic": "train"})`` colocates actor and critic on the same two bundles
    (in the same two processes, or with ``colocate="actor"`` in processes of
    their own with half a bundle each: see ``create_role_groups``). Roles
    mapped to different pools get different bundles.
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
