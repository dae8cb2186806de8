"""Resource pools: pure feasibility and ordering logic, then a real Ray cluster of fake-GPU nodes.

One two-node cluster for the module; the distinct-node tests add a third node or
remove the second for their duration, and put the cluster back as it was.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from unittest import mock

import pytest
import ray
import torch
import torch.distributed as dist
from deadlines import hang_guard
from ray import cloudpickle
from ray.util.placement_group import placement_group_table

from rl_e2e.ray_local import with_lazy_workers
from rl_e2e.ray_startup import patient_node_start
from trainer.controller import (
    Dispatch,
    InfeasibleError,
    NodeResources,
    RayResourcePool,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    check_feasible,
    create_role_groups,
)
from trainer.controller.resources import order_by_node

# pytest imports this file as a top-level module that Ray workers cannot
# import: ship the worker classes defined here by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _nodes(*sizes: tuple[float, float]) -> list[NodeResources]:
    return [
        NodeResources(f"id{i}", f"10.0.0.{i + 1}", {"CPU": cpu, "GPU": gpu})
        for i, (cpu, gpu) in enumerate(sizes)
    ]


def test_pool_describes_bundles_and_validates():
    pool = ResourcePool([4, 2], use_gpu=True, cpus_per_process=2)
    assert pool.world_size == 6
    assert pool.bundle() == {"CPU": 2.0, "GPU": 1.0}
    assert ResourcePool([1]).bundle() == {"CPU": 1.0}
    for bad in ([], [0], [2, -1], [1.5], [True]):
        with pytest.raises(
            ValueError, match="processes_per_node must be a non-empty list of positive ints"
        ):
            ResourcePool(bad)
    with pytest.raises(ValueError, match="num_threads"):
        ResourcePool([1], num_threads=0)
    with pytest.raises(ValueError, match="cpus_per_process"):
        ResourcePool([1], cpus_per_process=0)


def test_feasible_pools_pass():
    check_feasible({"actor": ResourcePool([4, 4], use_gpu=True)}, _nodes((8, 4), (8, 4)))
    check_feasible(
        {"a": ResourcePool([2], use_gpu=True), "b": ResourcePool([2], use_gpu=True)},
        _nodes((4, 4)),
    )


def test_strict_pack_larger_than_any_node_names_pool_nodes_and_request():
    with pytest.raises(InfeasibleError) as info:
        check_feasible({"actor": ResourcePool([8], use_gpu=True)}, _nodes((4, 4), (4, 4)))
    message = str(info.value)
    assert "resource pool 'actor' asks for 8 processes" in message
    assert "{CPU=8, GPU=8} in all" in message
    assert "10.0.0.1 {CPU=4, GPU=4}, 10.0.0.2 {CPU=4, GPU=4}" in message


def test_pools_that_fit_alone_but_not_together():
    pools = {"actor": ResourcePool([4], use_gpu=True), "critic": ResourcePool([4], use_gpu=True)}
    with pytest.raises(
        InfeasibleError, match=r"do not fit together.*'(actor|critic)'.*nodes: 10.0.0.1"
    ):
        check_feasible(pools, _nodes((8, 4)))
    with pytest.raises(InfeasibleError, match="no alive Ray nodes"):
        check_feasible(pools, [])


def test_entries_of_one_pool_need_distinct_nodes():
    check_feasible({"gpu": ResourcePool([2, 2], use_gpu=True)}, _nodes((4, 4), (4, 4)))
    with pytest.raises(InfeasibleError) as info:
        check_feasible({"gpu": ResourcePool([2, 2], use_gpu=True)}, _nodes((4, 4)))
    assert str(info.value) == (  # as docs/controller.md quotes it
        "resource pool 'gpu' asks for processes_per_node [2, 2] of {CPU=1, GPU=1}: its 2 "
        "entries need distinct nodes (one STRICT_PACK group per node, never two on one node), "
        "but only 1 of them fit on distinct nodes; nodes: 10.0.0.1 {CPU=4, GPU=4}"
    )
    # the largest entries are counted first: [4, 4, 1] fits 2 of 3 here, not 1
    with pytest.raises(InfeasibleError, match="only 2 of them fit on distinct nodes"):
        check_feasible(
            {"gpu": ResourcePool([4, 4, 1], use_gpu=True)}, _nodes((8, 4), (8, 1), (8, 1))
        )


def test_distinct_nodes_hold_together_with_other_pools():
    # one entry of each pool per node fits
    pools = {"a": ResourcePool([2, 2], use_gpu=True), "b": ResourcePool([2, 2], use_gpu=True)}
    check_feasible(pools, _nodes((4, 4), (4, 4)))
    # "b" fills one node; "a" alone fits two nodes, but with "b" only one node has room
    # and a second entry of "a" there would share a node with the first
    pools = {"a": ResourcePool([2, 2], use_gpu=True), "b": ResourcePool([4], use_gpu=True)}
    with pytest.raises(
        InfeasibleError,
        match=r"no room left for 2 processes of resource pool 'a' \(\{CPU=2, GPU=2\} on one node "
        r"that no other entry of the pool holds\)",
    ):
        check_feasible(pools, _nodes((8, 4), (8, 4)))


def test_nodes_are_ordered_by_numeric_address_then_id():
    nodes = [
        NodeResources("b", "10.0.0.10"),
        NodeResources("z", "10.0.0.9"),
        NodeResources("a", "10.0.0.10"),
        NodeResources("c", "10.0.0.9"),
    ]
    assert order_by_node(nodes) == [3, 1, 2, 0]


def test_manager_rejects_unknown_pool_and_role():
    with pytest.raises(ValueError, match=r"roles mapped to undefined pools: \{'critic': 'nope'\}"):
        ResourcePoolManager({"p": ResourcePool([1])}, {"actor": "p", "critic": "nope"})
    manager = ResourcePoolManager({"p": ResourcePool([1])}, {"actor": "p"})
    with pytest.raises(KeyError, match="role 'ref' is not mapped"):
        manager.pool_of("ref")


# -- a real two-node cluster, four fake GPUs per node -----------------------------


@contextlib.contextmanager
def _two_node_cluster(num_cpus: int = 4, num_gpus: int = 4):
    from ray.cluster_utils import Cluster

    # Under gpusched a CPU file gets CUDA_VISIBLE_DEVICES="" (it must not touch real
    # cards), and Ray refuses to fake GPUs that the variable hides: drop it here.
    with mock.patch.dict(os.environ):
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        with patient_node_start():  # a busy machine's raylets are slow
            cluster = Cluster(
                initialize_head=True,
                # The trainer's workers are actors: idle workers started ahead would serve none.
                head_node_args=with_lazy_workers(
                    {"num_cpus": num_cpus, "num_gpus": num_gpus, "include_dashboard": False}
                ),
            )
        try:
            with patient_node_start():
                cluster.add_node(num_cpus=num_cpus, num_gpus=num_gpus)
            ray.init(address=cluster.address)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes_shared():
    with _two_node_cluster() as cluster:
        yield cluster


class WhereWorker(Worker):
    dispatch = {"where": Dispatch.ONE_TO_ALL, "sum_ranks": Dispatch.ONE_TO_ALL}

    def where(self):
        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node": context.get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "resources": context.get_assigned_resources(),
            "port": self.master_port,
        }

    def sum_ranks(self) -> float:
        """All-reduce of the ranks over this worker's process group (gloo: the GPUs are fake)."""
        self.init_distributed("gloo")
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()


def test_strict_pack_infeasible_fails_fast_on_real_cluster(two_nodes_shared):
    manager = ResourcePoolManager({"actor": ResourcePool([8], use_gpu=True)}, {"actor": "actor"})
    start = time.monotonic()
    with pytest.raises(InfeasibleError) as info:
        create_role_groups(manager, {"actor": (WhereWorker, {})})
    assert time.monotonic() - start < 30  # fails at once, not after the 60 s placement timeout
    message = str(info.value)
    assert "resource pool 'actor' asks for 8 processes" in message
    assert message.count("{CPU=4, GPU=4}") == 2  # both nodes' sizes


def _sorted_node_ids() -> list[str]:
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return sorted(nodes, key=lambda i: (nodes[i], i))


def test_gpu_bundles_rank_i_in_bundle_i_on_sorted_nodes(two_nodes_shared):
    manager = ResourcePoolManager(
        {"gpu": ResourcePool([2, 1], use_gpu=True, cpus_per_process=0.5)}, {"actor": "gpu"}
    )
    try:
        group = create_role_groups(manager, {"actor": (WhereWorker, {})})["actor"]
        bundle_nodes = [n.node_id for n in manager.reserve()["gpu"].rank_nodes()]
        placed = group.where()
        group.shutdown()
    finally:
        manager.release()
    order = _sorted_node_ids()
    assert [p["rank"] for p in placed] == [0, 1, 2]
    # rank i runs in bundle i: the node of each rank is the node of its bundle
    assert [p["node"] for p in placed] == bundle_nodes
    # placement groups are ordered by node, so ranks never go back to an earlier node
    positions = [order.index(p["node"]) for p in placed]
    assert positions == sorted(positions) and len(set(positions)) == 2
    assert all(len(p["gpus"]) == 1 for p in placed)  # one fake GPU per bundle
    same_node = [p["gpus"] for p in placed if p["node"] == placed[0]["node"]]
    assert len(same_node) == 1 or same_node[0] != same_node[1]  # distinct cards on one node


def _rank_nodes(pool: ResourcePool, attempts: int) -> list[list[str]]:
    """The node id of each rank, for ``attempts`` reservations of ``pool`` one after another."""
    mappings = []
    for _attempt in range(attempts):
        manager = ResourcePoolManager({"gpu": pool}, {"actor": "gpu"})
        try:
            mappings.append([n.node_id for n in manager.reserve()["gpu"].rank_nodes()])
        finally:
            manager.release()
    return mappings


def test_rank_to_node_mapping_is_stable_across_restarts(two_nodes_shared):
    mappings = _rank_nodes(ResourcePool([2, 2], use_gpu=True), 3)
    first, second = _sorted_node_ids()
    assert mappings[0] == [first, first, second, second]
    assert mappings[1] == mappings[0] and mappings[2] == mappings[0]


def _wait_alive(count: int, timeout_s: float = hang_guard(30)) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(n["Alive"] for n in ray.nodes()) != count:
        assert time.monotonic() < deadline, f"{count} alive nodes expected: {ray.nodes()}"
        time.sleep(0.05)


def _two_per_node(ranks: list[str]) -> bool:
    return ranks[0] == ranks[1] and ranks[2] == ranks[3] and ranks[0] != ranks[2]


def test_entries_of_a_pool_land_on_distinct_nodes(two_nodes_shared):
    # Before the pool excluded the nodes of its earlier entries, Ray packed both groups
    # of [2, 2] onto one 4-GPU node in 2 of 6 reservations.
    pool = ResourcePool([2, 2], use_gpu=True)
    assert all(_two_per_node(ranks) for ranks in _rank_nodes(pool, 6))
    third = two_nodes_shared.add_node(num_cpus=4, num_gpus=4)
    try:
        two_nodes_shared.wait_for_nodes()
        assert all(_two_per_node(ranks) for ranks in _rank_nodes(pool, 6))
        # each group avoids the nodes of every earlier one, not only the last
        [ranks] = _rank_nodes(ResourcePool([1, 1, 1], use_gpu=True), 1)
        assert len(set(ranks)) == 3
    finally:
        two_nodes_shared.remove_node(third)
        _wait_alive(2)


def test_entries_that_would_share_the_only_node_fail_fast(two_nodes_shared):
    [worker] = two_nodes_shared.worker_nodes
    two_nodes_shared.remove_node(worker)
    try:
        _wait_alive(1)
        manager = ResourcePoolManager({"gpu": ResourcePool([2, 2], use_gpu=True)}, {"a": "gpu"})
        start = time.monotonic()
        with pytest.raises(InfeasibleError) as info:
            manager.reserve()
        assert time.monotonic() - start < 5
        message = str(info.value)
        assert "resource pool 'gpu' asks for processes_per_node [2, 2]" in message
        assert "entries need distinct nodes" in message and message.count("GPU=4}") == 1
        # Ray itself keeps the second group off the first one's node: reserved without
        # the check, it waits for a node of its own, and both groups are removed.
        with pytest.raises(
            InfeasibleError,
            match=r"not ready after 1 s \(no room for the group of 2 on a node the pool's other",
        ):
            RayResourcePool("gpu", ResourcePool([2, 2], use_gpu=True), timeout_s=1)
        assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    finally:
        two_nodes_shared.add_node(num_cpus=4, num_gpus=4)
        two_nodes_shared.wait_for_nodes()


def _colocated(colocate: str) -> tuple[dict[str, list], dict[str, list], dict[str, float]]:
    """``where()`` and ``sum_ranks()`` of two roles on one pool of two GPU bundles.

    Also returns what Ray reports still free in each bundle while both roles run.
    """
    manager = ResourcePoolManager(
        {"train": ResourcePool([2], use_gpu=True)}, {"actor": "train", "rollout": "train"}
    )
    try:
        groups = create_role_groups(
            manager, {"actor": (WhereWorker, {}), "rollout": (WhereWorker, {})}, colocate=colocate
        )
        where = {role: group.where() for role, group in groups.items()}
        sums = {role: group.sum_ranks() for role, group in groups.items()}
        available = ray.available_resources()
        free = {
            f"bundle {index}": available.get(f"GPU_group_{index}_{pg.id.hex()}", 0.0)
            for pg, index in manager.reserve()["train"].bundles()
        }
        for group in groups.values():
            group.shutdown()
    finally:
        manager.release()
    return where, sums, free


def test_colocate_actor_gives_each_role_its_own_process_and_half_a_card(two_nodes_shared):
    where, sums, free = _colocated("actor")
    actor, rollout = where["actor"], where["rollout"]
    assert len({w["pid"] for w in actor + rollout}) == 4  # one process per role and rank
    for rank in (0, 1):
        assert len(actor[rank]["gpus"]) == 1
        assert actor[rank]["gpus"] == rollout[rank]["gpus"]  # rank i of both roles: one card
        assert actor[rank]["node"] == rollout[rank]["node"]
    assert actor[0]["gpus"] != actor[1]["gpus"]
    # Ray's own accounting: half a card and half a CPU each, nothing left in the bundles
    assert all(w["resources"] == {"CPU": 0.5, "GPU": 0.5} for w in actor + rollout)
    assert free == {"bundle 0": 0.0, "bundle 1": 0.0}
    # each role has its own rendezvous address and process group of two ranks
    assert actor[0]["port"] != rollout[0]["port"]
    assert sums == {"actor": [1.0, 1.0], "rollout": [1.0, 1.0]}


def test_colocate_process_keeps_roles_in_one_process_with_the_whole_card(two_nodes_shared):
    where, sums, free = _colocated("process")
    actor, rollout = where["actor"], where["rollout"]
    assert [w["pid"] for w in actor] == [w["pid"] for w in rollout]
    assert len({w["pid"] for w in actor}) == 2
    assert [w["gpus"] for w in actor] == [w["gpus"] for w in rollout]
    assert all(w["resources"] == {"CPU": 1.0, "GPU": 1.0} for w in actor)
    assert free == {"bundle 0": 0.0, "bundle 1": 0.0}
    assert actor[0]["port"] == rollout[0]["port"]  # one process group per pool
    assert sums == {"actor": [1.0, 1.0], "rollout": [1.0, 1.0]}
