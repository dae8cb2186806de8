"""How colocated roles share a pool's bundles: the pure plan, no Ray."""

from __future__ import annotations

import pytest

from trainer.controller import ResourcePool, ResourcePoolManager, create_role_groups
from trainer.controller.colocation import HostSet, plan_hosts

POOLS = {
    "train": ResourcePool([2], use_gpu=True, cpus_per_process=1),
    "ref": ResourcePool([1], cpus_per_process=2),
}
ROLES = {"actor": "train", "rollout": "train", "critic": "train", "ref": "ref"}


def test_process_mode_hosts_every_role_of_a_pool_in_one_process_per_bundle():
    assert plan_hosts(ROLES, POOLS, "process") == [
        HostSet("train", ("actor", "rollout", "critic"), num_cpus=1.0, num_gpus=1.0),
        HostSet("ref", ("ref",), num_cpus=2.0, num_gpus=0.0),
    ]


def test_actor_mode_gives_each_role_a_share_that_always_fits_the_bundle():
    plan = plan_hosts(ROLES, POOLS, "actor")
    assert [h.roles for h in plan] == [("actor",), ("rollout",), ("critic",), ("ref",)]
    # a third, rounded down to Ray's 1/10000 unit: three shares never exceed the bundle
    assert {(h.num_cpus, h.num_gpus) for h in plan[:3]} == {(0.3333, 0.3333)}
    assert (plan[3].num_cpus, plan[3].num_gpus) == (2.0, 0.0)  # alone on its pool
    two = plan_hosts({"actor": "train", "rollout": "train"}, POOLS, "actor")
    assert [(h.num_cpus, h.num_gpus) for h in two] == [(0.5, 0.5), (0.5, 0.5)]


def test_actor_mode_shares_above_one_card_must_be_whole_cards():
    pools = {"big": ResourcePool([1], use_gpu=True, gpus_per_process=4)}
    two = plan_hosts({"a": "big", "b": "big"}, pools, "actor")
    assert [h.num_gpus for h in two] == [2.0, 2.0]
    with pytest.raises(ValueError, match=r"pool 'big' \(4 GPUs\) among its 3 roles: 1\.3333 GPUs"):
        plan_hosts({"a": "big", "b": "big", "c": "big"}, pools, "actor")


def test_unknown_colocate_mode_is_refused_before_anything_is_reserved():
    manager = ResourcePoolManager(POOLS, ROLES)
    with pytest.raises(
        ValueError, match=r"colocate must be one of \['process', 'actor'\], got 'thread'"
    ):
        create_role_groups(manager, {}, colocate="thread")  # no Ray running: nothing was reserved
