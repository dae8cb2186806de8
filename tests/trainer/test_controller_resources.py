"""Resource pools: pure feasibility and ordering logic, then a real two-node Ray cluster."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from unittest import mock

import pytest
import ray
from ray import cloudpickle

from trainer.controller import (
    Dispatch,
    InfeasibleError,
    NodeResources,
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
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": num_cpus, "num_gpus": num_gpus, "include_dashboard": False},
        )
        try:
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
    dispatch = {"where": Dispatch.ONE_TO_ALL}

    def where(self):
        return {
            "rank": self.rank,
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }


def test_strict_pack_infeasible_fails_fast_on_real_cluster(two_nodes_shared):
    manager = ResourcePoolManager({"actor": ResourcePool([8], use_gpu=True)}, {"actor": "actor"})
    start = time.monotonic()
    with pytest.raises(InfeasibleError) as info:
        create_role_groups(manager, {"actor": (WhereWorker, {})})
    assert time.monotonic() - start < 5  # fails at once, not after a placement timeout
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


def test_rank_to_node_mapping_is_stable_across_restarts(two_nodes_shared):
    mappings = []
    # Groups of 3 on 4-GPU nodes cannot share a node. With [2, 2], Ray may pack both
    # groups onto one node: the pool does not yet pin its groups to distinct nodes.
    for _attempt in range(3):
        manager = ResourcePoolManager({"gpu": ResourcePool([3, 3], use_gpu=True)}, {"actor": "gpu"})
        try:
            reserved = manager.reserve()["gpu"]
            mappings.append([n.node_id for n in reserved.rank_nodes()])
        finally:
            manager.release()
    first, second = _sorted_node_ids()
    assert mappings[0] == [first, first, first, second, second, second]
    assert mappings[1] == mappings[0] and mappings[2] == mappings[0]
