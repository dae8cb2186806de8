"""Dispatch modes and dispatch-table validation: pure logic, no Ray."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from trainer.controller import Dispatch, DispatchSpec, Worker, WorkerContext, create_worker
from trainer.controller.dispatch import collect_results, split_call
from trainer.controller.rendezvous import default_backend


def _td(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n), "y": torch.arange(n) * 10.0}, batch_size=[n])


def _run_locally(mode: Dispatch, world_size: int, fn, *args, **kwargs):
    """Split, run ``fn`` per rank in this process, collect: the group's logic without Ray."""
    split = split_call(mode, world_size, args, kwargs, "fn")
    results = [
        fn(r, *a, **k) for r, a, k in zip(split.ranks, split.args, split.kwargs, strict=True)
    ]
    return split, collect_results(mode, results, split.pad_size)


@pytest.mark.parametrize("size,world", [(8, 4), (5, 2), (7, 4), (1, 3)])
def test_dp_split_round_trips_exactly(size, world):
    td = _td(size)
    split, out = _run_locally(
        Dispatch.DP_SPLIT, world, lambda r, b, scale: b.apply(lambda t: t * scale), td, scale=3
    )
    # every rank got the same number of rows: padding really happened
    assert len({a[0].batch_size[0] for a in split.args}) == 1
    assert sum(a[0].batch_size[0] for a in split.args) == size + split.pad_size
    assert split.kwargs[0] == {"scale": 3}
    assert torch.equal(out["x"], td["x"] * 3) and torch.equal(out["y"], td["y"] * 3)


def test_dp_split_non_tensordict_results_come_back_per_rank():
    _, out = _run_locally(Dispatch.DP_SPLIT, 3, lambda r, b: (r, b.batch_size[0]), _td(7))
    assert out == [(0, 3), (1, 3), (2, 3)]


def test_dp_split_errors():
    with pytest.raises(TypeError, match="fn: DP_SPLIT needs at least one TensorDict"):
        split_call(Dispatch.DP_SPLIT, 2, (1,), {}, "fn")
    with pytest.raises(ValueError, match="differ in batch size"):
        split_call(Dispatch.DP_SPLIT, 2, (_td(3),), {"other": _td(4)}, "fn")


def test_one_to_all_all_to_all_rank_zero():
    _, out = _run_locally(Dispatch.ONE_TO_ALL, 3, lambda r, a, b=0: (r, a, b), "x", b=1)
    assert out == [(0, "x", 1), (1, "x", 1), (2, "x", 1)]
    _, out = _run_locally(Dispatch.ALL_TO_ALL, 2, lambda r, a, b: (r, a, b), [10, 11], b=["p", "q"])
    assert out == [(0, 10, "p"), (1, 11, "q")]
    split, out = _run_locally(Dispatch.RANK_ZERO, 4, lambda r, a: (r, a), "z")
    assert split.ranks == (0,) and out == (0, "z")


def test_all_to_all_needs_one_item_per_rank():
    with pytest.raises(
        ValueError, match="fn: ALL_TO_ALL needs argument 0 to be a list of 3 items.*length 2"
    ):
        split_call(Dispatch.ALL_TO_ALL, 3, ([1, 2],), {}, "fn")
    with pytest.raises(ValueError, match="needs b to be a list of 2 items.*got int"):
        split_call(Dispatch.ALL_TO_ALL, 2, (), {"b": 5}, "fn")


def test_dispatch_table_is_normalised_and_inherited():
    class Base(Worker):
        dispatch = {"a": Dispatch.ONE_TO_ALL}

        def a(self):
            return 1

    class Child(Base):
        dispatch = {"b": DispatchSpec(Dispatch.DP_SPLIT, blocking=False)}

        def b(self, batch):
            return batch

    assert Base.dispatch == {"a": DispatchSpec(Dispatch.ONE_TO_ALL)}
    assert Child.dispatch == {
        "a": DispatchSpec(Dispatch.ONE_TO_ALL),
        "b": DispatchSpec(Dispatch.DP_SPLIT, blocking=False),
    }
    with pytest.raises(TypeError):
        Child.dispatch["c"] = Dispatch.RANK_ZERO  # read-only after validation


def test_typo_in_dispatch_table_fails_at_class_definition():
    with pytest.raises(
        AttributeError, match="CriticWorker.dispatch names 'compute_valeus', which is not a method"
    ):

        class CriticWorker(Worker):
            dispatch = {"compute_valeus": Dispatch.DP_SPLIT}

            def compute_values(self, batch):
                return batch


def test_dispatch_table_rejects_non_methods_and_bad_modes():
    with pytest.raises(AttributeError, match="names 'n', which is not a method"):

        class W1(Worker):
            dispatch = {"n": Dispatch.ONE_TO_ALL}
            n = 3

    with pytest.raises(
        TypeError, match=r"W2.dispatch\['f'\]: expected a Dispatch or DispatchSpec, got str"
    ):

        class W2(Worker):
            dispatch = {"f": "dp_split"}

            def f(self):
                pass

    with pytest.raises(TypeError, match="'_f' is not a public method name"):

        class W3(Worker):
            dispatch = {"_f": Dispatch.ONE_TO_ALL}

            def _f(self):
                pass

    with pytest.raises(TypeError, match="DispatchSpec.mode must be a Dispatch"):
        DispatchSpec("one_to_all")


def test_context_is_set_before_subclass_init():
    seen = {}

    class W(Worker):
        def __init__(self, tag):
            super().__init__()
            seen.update(
                rank=self.rank,
                world=self.world_size,
                port=self.master_port,
                role=self.role,
                tag=tag,
            )

    create_worker(
        W,
        WorkerContext(
            rank=2, world_size=4, master_addr="10.0.0.1", master_port=1234, role="critic"
        ),
        {"tag": "t"},
    )
    assert seen == {"rank": 2, "world": 4, "port": 1234, "role": "critic", "tag": "t"}
    plain = W("u")  # outside a group: rank 0 of 1
    assert (plain.rank, plain.world_size) == (0, 1)


def test_init_distributed_outside_a_group(monkeypatch):
    class Solo(Worker):
        pass

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "unset")  # init_distributed sets them; restored after the test

    lone = Solo()  # rank 0 of 1: picks its own port
    try:
        lone.init_distributed()
        # Outside Ray there is no grant: NCCL where CUDA is usable (a GPU node), else gloo.
        assert dist.get_world_size() == 1 and dist.get_backend() == default_backend()
        lone.init_distributed()  # idempotent
    finally:
        dist.destroy_process_group()
    stray = create_worker(Solo, WorkerContext(rank=1, world_size=2), {})
    with pytest.raises(RuntimeError, match="rank 1 of 2 has no master_port"):
        stray.init_distributed()
