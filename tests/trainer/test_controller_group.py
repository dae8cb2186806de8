"""Role groups on a real local Ray cluster: dispatch round trips, colocation, failures.

One cluster for the module; the groups are created once (module scope) and
shared, except the crash test which builds and throws away its own group.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import traceback
from collections import deque

import pytest
import ray
import torch
import torch.distributed as dist
from deadlines import hang_guard
from ray import cloudpickle
from ray.exceptions import OwnerDiedError
from tensordict import TensorDict

from trainer.controller import (
    Dispatch,
    DispatchSpec,
    InfeasibleError,
    PendingCall,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    WorkerDiedError,
    WorkerError,
    create_role_groups,
)
from trainer.controller.errors import InputLostError
from trainer.controller.group import _fetch_one
from trainer.controller.host import WorkerHost
from trainer.controller.layout import Piece
from trainer.controller.resident import Resident, ShardColumns, ShardPlan
from trainer.data import batch as B
from trainer.loop.rollouts import PooledRollouts, _Pending

# pytest imports this file as a top-level module that Ray workers cannot
# import: ship the worker classes defined here by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CriticWorker(Worker):
    dispatch = {
        "init_model": Dispatch.ONE_TO_ALL,
        "compute_values": Dispatch.DP_SPLIT,
        "describe": Dispatch.ONE_TO_ALL,
        "scatter": Dispatch.ALL_TO_ALL,
        "state_dict": Dispatch.RANK_ZERO,
        "fail_on": Dispatch.ONE_TO_ALL,
        "sum_ranks": DispatchSpec(Dispatch.ONE_TO_ALL, blocking=False),
    }

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.seen: list[int] = []

    def init_model(self) -> str:
        self.init_distributed()
        return dist.get_backend()

    def compute_values(self, batch: TensorDict, bias: float = 0.0) -> TensorDict:
        """Values of every row: ``scale * x + bias``, with who computed them."""
        self.seen.append(B.batch_len(batch))
        n = B.batch_len(batch)
        out = TensorDict(
            {
                "values": batch["x"].float() * self.scale + bias,
                "rank": torch.full((n,), self.rank),
            },
            batch_size=[n],
        )
        out.set("echo", batch.get("prompt"))
        return out

    def describe(self) -> dict:
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "role": self.role,
            "threads": torch.get_num_threads(),
            "seen": list(self.seen),
        }

    def scatter(self, item: int, tag: str, method: str = "m") -> tuple[int, int, str, str]:
        return self.rank, item, tag, method

    def state_dict(self) -> dict:
        return {"rank": self.rank, "scale": self.scale}

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad value on purpose in {self.role}")
        return self.rank

    def sum_ranks(self) -> float:
        """All-reduce of the ranks over the (shared) process group."""
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()


class ActorWorker(CriticWorker):
    dispatch = {"update_actor": Dispatch.DP_SPLIT}

    def update_actor(self, batch: TensorDict) -> dict:
        return {"actor/loss": float(batch["x"].float().mean()), "actor/rows": B.batch_len(batch)}


class CrashWorker(Worker):
    dispatch = {"init": Dispatch.ONE_TO_ALL, "crash": Dispatch.ONE_TO_ALL}

    def init(self) -> None:
        self.init_distributed()

    def crash(self) -> float:
        if self.rank == 1:
            os._exit(1)
        value = torch.ones(1)
        dist.all_reduce(value)  # rank 0 blocks here: its peer is gone
        return value.item()


@pytest.fixture(scope="module")
def e2e_ray_options():
    """Five CPUs: the shared groups hold three, the other tests start up to two more."""
    return {"num_cpus": 5}


@pytest.fixture(scope="module")
def groups_shared(e2e_ray):
    manager = ResourcePoolManager(
        {"train": ResourcePool([2]), "ref": ResourcePool([1])},
        {"actor": "train", "critic": "train", "ref": "ref"},
    )
    try:
        groups = create_role_groups(
            manager,
            {
                "actor": (ActorWorker, {"scale": 2.0}),
                "critic": (CriticWorker, {"scale": 3.0}),
                "ref": (CriticWorker, {"scale": 5.0}),
            },
        )
        yield groups
    finally:
        manager.release()


def _batch(n: int) -> TensorDict:
    return B.from_samples([{"x": i, "prompt": f"p{i}"} for i in range(n)])


def test_dp_split_round_trips_a_batch_that_does_not_divide_the_world(groups_shared):
    critic = groups_shared["critic"]
    batch = _batch(5)
    out = critic.compute_values(batch, bias=1.0)
    assert B.batch_len(out) == 5
    assert out["values"].tolist() == [3.0 * i + 1.0 for i in range(5)]
    assert out["echo"] == ["p0", "p1", "p2", "p3", "p4"]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1]  # rank 1 got rows 3, 4 and one pad row
    assert [d["seen"][-1] for d in critic.describe()] == [3, 3]  # both ranks got 3 rows
    assert torch.equal(critic.compute_values(_batch(4))["values"], torch.arange(4) * 3.0)


def test_dp_split_non_tensordict_results_are_per_rank(groups_shared):
    assert groups_shared["actor"].update_actor(_batch(6)) == [
        {"actor/loss": 1.0, "actor/rows": 3},
        {"actor/loss": 4.0, "actor/rows": 3},
    ]


def test_one_to_all_all_to_all_rank_zero_and_non_blocking(groups_shared):
    critic = groups_shared["critic"]
    described = critic.describe()
    assert [(d["rank"], d["world_size"], d["role"]) for d in described] == [
        (0, 2, "critic"),
        (1, 2, "critic"),
    ]
    # keyword names that the plumbing itself uses ("method") reach the worker intact
    assert critic.scatter([10, 11], tag=["a", "b"], method=["x", "y"]) == [
        (0, 10, "a", "x"),
        (1, 11, "b", "y"),
    ]
    assert critic.state_dict() == {"rank": 0, "scale": 3.0}
    with pytest.raises(
        ValueError, match="critic.scatter: ALL_TO_ALL needs argument 0 to be a list of 2"
    ):
        critic.scatter([1], tag=["a", "b"])


def test_colocated_roles_share_a_process_and_its_process_group(groups_shared):
    actor, critic, ref = (groups_shared[r].describe() for r in ("actor", "critic", "ref"))
    assert [d["pid"] for d in actor] == [d["pid"] for d in critic]
    assert len({d["pid"] for d in actor}) == 2
    assert ref[0]["pid"] not in {d["pid"] for d in actor}
    assert all(d["threads"] == 1 for d in actor + ref)  # ResourcePool.num_threads
    assert groups_shared["actor"].init_model() == ["gloo", "gloo"]
    assert groups_shared["critic"].init_model() == ["gloo", "gloo"]  # idempotent, shared
    pending = groups_shared["critic"].sum_ranks()
    assert isinstance(pending, PendingCall)
    assert pending.get() == [1.0, 1.0]


def test_proxies_are_real_functions_named_after_the_methods(groups_shared):
    proxy = groups_shared["critic"].compute_values
    assert inspect.isfunction(proxy)
    assert proxy.__name__ == "compute_values"
    assert proxy.__doc__ == CriticWorker.compute_values.__doc__
    assert (
        str(inspect.signature(proxy))
        == "(batch: 'TensorDict', bias: 'float' = 0.0) -> 'TensorDict'"
    )
    assert not hasattr(groups_shared["critic"], "update_actor")
    with pytest.raises(TypeError) as info:
        proxy("not a batch")
    assert "compute_values" in [frame.name for frame in traceback.extract_tb(info.tb)]


def test_worker_exception_carries_rank_role_and_remote_traceback(groups_shared):
    with pytest.raises(WorkerError) as info:
        groups_shared["critic"].fail_on(1)
    error = info.value
    assert (error.role, error.rank, error.method) == ("critic", 1, "fail_on")
    message = str(error)
    assert "critic.fail_on failed on rank 1" in message
    assert "ValueError: bad value on purpose in critic" in message
    assert 'in fail_on\n    raise ValueError(f"bad value on purpose' in message
    assert groups_shared["critic"].fail_on(7) == [0, 1]  # the group still works


def test_dispatch_names_that_clash_with_the_group_are_refused(e2e_ray):
    class Clash(Worker):
        dispatch = {"shutdown": Dispatch.ONE_TO_ALL}

        def shutdown(self):
            pass

    manager = ResourcePoolManager({"p": ResourcePool([1])}, {"x": "p"})
    with pytest.raises(
        ValueError, match=r"Clash.dispatch names \['shutdown'\], which RoleGroup itself uses"
    ):
        create_role_groups(manager, {"x": (Clash, {})})
    with pytest.raises(KeyError, match="role 'y' is not mapped"):
        create_role_groups(manager, {"y": (Clash, {})})


class BrokenInitWorker(Worker):
    dispatch = {"ping": Dispatch.ONE_TO_ALL}

    def __init__(self, path: str) -> None:
        super().__init__()
        with open(path) as handle:  # the path does not exist
            handle.read()

    def ping(self) -> int:
        return self.rank


def test_worker_constructor_error_names_role_and_rank(groups_shared):
    manager = ResourcePoolManager({"solo": ResourcePool([1])}, {"broken": "solo"})
    try:
        with pytest.raises(WorkerError) as info:
            create_role_groups(
                manager, {"broken": (BrokenInitWorker, {"path": "/nonexistent/cfg"})}
            )
    finally:
        manager.release()
    assert (info.value.role, info.value.rank, info.value.method) == ("broken", 0, "__init__")
    assert "FileNotFoundError" in str(info.value) and "/nonexistent/cfg" in str(info.value)


def test_pool_feasible_on_paper_but_taken_is_an_error_not_a_wait(groups_shared):
    # 5 CPUs in the cluster, 3 held by the shared groups: 3 more fit on paper only
    manager = ResourcePoolManager({"late": ResourcePool([3])}, {"late": "late"})
    start = time.monotonic()
    with pytest.raises(InfeasibleError, match=r"resource pool 'late'.*not ready after 1 s"):
        manager.reserve(timeout_s=1)
    assert time.monotonic() - start < hang_guard(10)
    assert ray.util.placement_group_table() and all(
        pg["state"] != "PENDING" for pg in ray.util.placement_group_table().values()
    )  # the pending group was removed, not left to grab resources later


def test_worker_that_dies_is_a_clear_error_not_a_hang(groups_shared):
    manager = ResourcePoolManager({"fragile": ResourcePool([2])}, {"crash": "fragile"})
    try:
        group = create_role_groups(manager, {"crash": (CrashWorker, {})})["crash"]
        group.init()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            group.crash()  # rank 0 stays blocked in all_reduce; the driver must not wait for it
        assert time.monotonic() - start < hang_guard(30)
        assert info.value.rank == 1 and info.value.role == "crash"
        assert "the process of rank 1 (role 'crash') died during crash.crash" in str(info.value)
        group.shutdown()
    finally:
        manager.release()


@ray.remote(num_cpus=0)
class BatchOwner:
    """Holds a batch column in the object store, as a rollout worker holds the batch it made."""

    def keep(self) -> list:
        return [ray.put(TensorDict({"x": torch.ones(2)}, batch_size=[2]))]


def test_an_input_lost_with_the_process_holding_it_is_told_apart(groups_shared):
    """The rank cannot read its part of a resident batch: InputLostError, not its own failure."""
    owner = BatchOwner.remote()
    [ref] = ray.get(owner.keep.remote())
    ray.kill(owner)
    plan = ShardPlan(pieces=(Piece(0, 0, 2),), columns={"x": {0: ref}})
    host = WorkerHost.options(num_cpus=0).remote(0, None)
    try:
        with pytest.raises(InputLostError) as info:
            _fetch_one(host.call.remote("actor", "update_actor", plan), 0, "actor", "update_actor")
    finally:
        ray.kill(host)
    assert (info.value.role, info.value.rank, info.value.method) == ("actor", 0, "update_actor")
    assert "OwnerDiedError" in info.value.remote_traceback


def test_the_drivers_own_read_of_a_lost_batch_is_an_input_lost_error_too(groups_shared):
    """The driver reads a column of a batch whose maker died: InputLostError as for a rank,
    so the trainer reports the maker's death (which Ray may report after the read fails)."""
    owner = BatchOwner.remote()
    [ref], [probe] = ray.get([owner.keep.remote(), owner.keep.remote()])
    ray.kill(owner)
    deadline = time.monotonic() + hang_guard(30)
    while time.monotonic() < deadline:  # until this process has heard of the owner's death
        try:
            ray.get(probe)
        except OwnerDiedError:
            break
        time.sleep(0.1)
    batch = Resident.from_shards([ShardColumns({"x": ref}, 2, {"x": 8})], 2)
    with pytest.raises(InputLostError) as info:
        batch["x"]
    assert (info.value.role, info.value.method) == ("driver", "read of x")
    assert "OwnerDiedError" in info.value.remote_traceback


def test_a_lost_input_is_reported_as_the_rollout_workers_death_that_caused_it():
    """What the trainer raises for an InputLostError: a queued call's WorkerDiedError."""
    died = WorkerDiedError("rollout", 0, "generate_sequences", "exit code 3")

    def dies() -> None:
        raise died

    def raises() -> None:
        raise WorkerError("rollout", 1, "load_weights", "ValueError")

    rollouts = PooledRollouts.__new__(PooledRollouts)  # only its queue and pushes are read
    rollouts.queue, rollouts.acks = deque([_Pending(None, PendingCall(raises))]), []
    assert rollouts.death_meanwhile(0.1) is None  # a raised error is that call's own
    rollouts.acks = [(2, "fingerprint", 0.0, PendingCall(dies))]
    assert rollouts.death_meanwhile(0.1) is died


class NcclWorker(Worker):
    dispatch = {"all_reduce_on_gpu": Dispatch.ONE_TO_ALL}

    def all_reduce_on_gpu(self) -> tuple[str, float, str]:
        self.init_distributed()
        value = torch.full((1,), float(self.rank + 1), device="cuda")
        dist.all_reduce(value)
        return dist.get_backend(), value.item(), os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.gpu1
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False"
)
def test_gpu_pool_brings_up_nccl_on_its_card(e2e_ray):
    manager = ResourcePoolManager({"gpu": ResourcePool([1], use_gpu=True)}, {"gpu": "gpu"})
    try:
        group = create_role_groups(manager, {"gpu": (NcclWorker, {})})["gpu"]
        [(backend, total, visible)] = group.all_reduce_on_gpu()
        group.shutdown()
    finally:
        manager.release()
    assert backend == "nccl" and total == 1.0
    assert visible != ""  # Ray gave the process its card
