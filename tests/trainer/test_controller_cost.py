"""The controller's cost, measured per call on a real local Ray cluster: bytes and seconds.

Role groups of two ranks and of one on the e2e plugin's cluster; each call
runs inside a :class:`~trainer.controller.ledger.Ledger` and the test
compares what it recorded with what the test itself sent, received and made
the workers do. Resident batches (results kept in Ray's object store,
:mod:`trainer.controller.resident`) are checked here too: what stays out of
the driver's path and what each rank reads instead. The same figures per
step, written to ``metrics.jsonl`` by ``python -m trainer``, are checked in
``test_main.py``.
"""

from __future__ import annotations

import gc
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle
from tensordict import TensorDict

from trainer.controller import (
    Dispatch,
    DispatchSpec,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    create_role_groups,
)
from trainer.controller.ledger import Ledger, move, tensor_bytes
from trainer.controller.resident import Resident

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file

NAP_S = 0.3  # what each rank's method spends in the worker


class EchoWorker(Worker):
    dispatch = {
        "double": Dispatch.DP_SPLIT,
        "nap": Dispatch.ONE_TO_ALL,
        "nap_later": DispatchSpec(Dispatch.ONE_TO_ALL, blocking=False),
        "make": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "halve": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "seen": Dispatch.DP_SPLIT,
    }

    def double(self, batch: TensorDict) -> TensorDict:
        """Rows times two, as float64 (twice the bytes of the int32 input), copied by ``move``."""
        x = move(batch["x"], "cpu").double() * 2
        return TensorDict({"y": x}, batch_size=batch.batch_size)

    def nap(self) -> int:
        time.sleep(NAP_S)
        return self.rank

    def nap_later(self) -> int:
        return self.nap()

    def make(self, batch: TensorDict) -> TensorDict:
        """``y``: rows times two (float64); ``id``: the row's number (int64)."""
        y = batch["x"].double() * 2
        return TensorDict({"y": y, "id": batch["x"].long()}, batch_size=batch.batch_size)

    def halve(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"h": batch["y"] / 2}, batch_size=batch.batch_size)

    def seen(self, batch: TensorDict, other: TensorDict | None = None) -> dict[str, list]:
        """The rows this rank got, column by column (not a TensorDict: nothing is joined)."""
        return {key: batch[key].tolist() for key in sorted(batch.keys())}


@pytest.fixture(scope="module")
def e2e_ray_options():
    return {"num_cpus": 3}


@pytest.fixture(scope="module")
def echo_groups(e2e_ray):
    """``echo``: two ranks; ``solo``: one rank in a pool of its own."""
    manager = ResourcePoolManager(
        {"pool": ResourcePool([2]), "solo": ResourcePool([1])}, {"echo": "pool", "solo": "solo"}
    )
    groups = create_role_groups(manager, {"echo": (EchoWorker, {}), "solo": (EchoWorker, {})})
    try:
        yield groups
    finally:
        for group in groups.values():
            group.shutdown()
            group.pool.release()


@pytest.fixture
def echo_group(echo_groups):
    return echo_groups["echo"]


def test_bytes_are_the_tensors_sent_and_received(echo_group):
    batch = TensorDict({"x": torch.arange(8, dtype=torch.int32)}, batch_size=[8])
    ledger = Ledger().start()
    try:
        out = echo_group.double(batch)
    finally:
        ledger.stop()
    assert torch.equal(out["y"], torch.arange(8, dtype=torch.float64) * 2)
    figures = ledger.metrics(step_s=10.0)
    assert figures["perf/driver_bytes_sent"] == tensor_bytes(batch) == 8 * 4
    assert figures["perf/driver_bytes_received"] == tensor_bytes(out) == 8 * 8
    assert figures["perf/driver_bytes"] == 8 * 4 + 8 * 8
    assert figures["perf/worker_calls"] == 1


def test_the_workers_own_seconds_are_not_the_controllers(echo_group):
    ledger = Ledger().start()
    t0 = time.perf_counter()
    try:
        assert echo_group.nap() == [0, 1]
    finally:
        step_s = time.perf_counter() - t0
        ledger.stop()
    figures = ledger.metrics(step_s)
    assert figures["timing/worker_compute"] >= NAP_S
    assert figures["timing/worker_compute"] <= step_s
    parts = (
        figures["timing/controller"]
        + figures["timing/worker_compute"]
        + figures["timing/driver_math"]
    )
    assert parts == pytest.approx(step_s)
    assert figures["timing/controller"] == pytest.approx(
        figures["timing/serialize"] + figures["timing/call_latency"]
    )
    assert figures["perf/driver_bytes"] == 0  # no tensor went either way


def test_a_pending_call_counts_only_the_wait_it_costs_the_driver(echo_group):
    ledger = Ledger().start()
    try:
        pending = echo_group.nap_later()
        while not pending.ready():  # the driver's own work while the ranks nap
            time.sleep(0.05)
        assert pending.get() == [0, 1]
    finally:
        ledger.stop()
    figures = ledger.metrics(step_s=10.0)
    # The ranks napped while the driver worked: what the driver waited for, not what they did.
    assert figures["timing/worker_compute"] < NAP_S
    assert figures["perf/worker_calls"] == 1


def test_calls_outside_an_open_ledger_are_not_recorded(echo_group):
    ledger = Ledger().start()
    ledger.stop()
    echo_group.nap()
    assert ledger.metrics(step_s=1.0)["perf/worker_calls"] == 0


# ----------------------------------------------------------------------------- resident batches


def _ints(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n, dtype=torch.int32)}, batch_size=[n])


def _counted(call):
    ledger = Ledger().start()
    try:
        out = call()
    finally:
        ledger.stop()
    return out, ledger.metrics(step_s=10.0)


def test_a_resident_result_stays_with_the_workers_until_the_driver_reads_a_column(echo_group):
    batch = _ints(5)  # padded to 6 for the two ranks
    res, figures = _counted(lambda: echo_group.make(batch))
    assert isinstance(res, Resident) and len(res) == 5 and res.keys() == ["y", "id"]
    assert figures["perf/driver_bytes_sent"] == tensor_bytes(batch) + 4  # and the padding row
    assert figures["perf/driver_bytes_received"] == 0  # references only
    assert res.tensor_bytes() == 5 * 8 + 5 * 8  # the real rows, not the padding

    y, figures = _counted(lambda: res["y"])
    assert torch.equal(y, torch.arange(5, dtype=torch.float64) * 2)
    assert figures["perf/driver_bytes_received"] == 5 * 8  # that column, its real rows
    assert figures["perf/driver_bytes_sent"] == 0
    again, figures = _counted(lambda: res["y"])
    assert again is y and figures["perf/driver_bytes"] == 0  # read once


def test_a_resident_batch_reaches_the_next_call_through_the_object_store(echo_group):
    res = echo_group.make(_ints(5))
    adv = -torch.arange(5, dtype=torch.float32)
    _, figures = _counted(lambda: res.__setitem__("adv", adv))
    assert figures["perf/driver_bytes_sent"] == 5 * 4  # the driver's column goes once

    seen, figures = _counted(lambda: echo_group.seen(res))
    assert figures["perf/driver_bytes"] == 0  # no tensor went through the driver
    # The rows a DP_SPLIT of the plain batch sends: rank 1's last row repeats row 0.
    assert [s["id"] for s in seen] == [[0, 1, 2], [3, 4, 0]]
    assert [s["adv"] for s in seen] == [[0.0, -1.0, -2.0], [-3.0, -4.0, 0.0]]
    assert [s["y"] for s in seen] == [[0.0, 2.0, 4.0], [6.0, 8.0, 0.0]]


def test_a_group_of_another_size_reads_the_same_rows(echo_groups):
    from_two = echo_groups["echo"].make(_ints(5))
    assert echo_groups["solo"].seen(from_two)[0]["id"] == [0, 1, 2, 3, 4]
    from_one = echo_groups["solo"].make(_ints(5))
    assert [s["id"] for s in echo_groups["echo"].seen(from_one)] == [[0, 1, 2], [3, 4, 0]]


def test_padded_rows_read_zero_in_the_columns_that_carry_the_loss(echo_groups):
    res = echo_groups["echo"].make(_ints(5))
    res["adv"] = torch.arange(1, 6, dtype=torch.float32)
    (rows,) = echo_groups["solo"].seen(res.padded(4, zero=["adv"]))
    assert rows["id"] == [0, 1, 2, 3, 4, 0, 1, 2]  # padded to 8 with rows 0, 1, 2
    assert rows["adv"] == [1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0]
    assert rows["y"] == [0.0, 2.0, 4.0, 6.0, 8.0, 0.0, 2.0, 4.0]  # other columns as they are


def test_results_join_where_they_lie_and_mismatches_are_named(echo_groups):
    echo, solo = echo_groups["echo"], echo_groups["solo"]
    res = echo.make(_ints(5))
    joined, figures = _counted(lambda: res.update(echo.halve(res)))
    assert figures["perf/driver_bytes"] == 0
    assert torch.equal(joined["h"], torch.arange(5, dtype=torch.float64))
    assert res.select("id").keys() == ["id"] and "h" not in res.exclude("h")

    with pytest.raises(ValueError, match=r"different layouts: shards \[3, 3\] with 5 real rows"):
        res.update(solo.halve(res))
    with pytest.raises(TypeError, match="resident and driver-side batches together"):
        echo.seen(res, other=_ints(5))
    with pytest.raises(KeyError, match=r"no column 'nope' \(columns: \['y', 'id', 'h'\]\)"):
        res["nope"]
    with pytest.raises(ValueError, match=r"column 'w' has 4 rows; the batch has 5"):
        res["w"] = torch.zeros(4)
    with pytest.raises(ValueError, match="resident needs Dispatch.DP_SPLIT"):
        DispatchSpec(Dispatch.ONE_TO_ALL, resident=True)


def test_a_dropped_batch_leaves_no_reference_on_the_driver(echo_groups):
    """What keeps the objects alive is the driver's handle: dropped, Ray may free them."""
    table = ray._private.worker.global_worker.core_worker.get_all_reference_counts

    def held() -> set[str]:  # the ids (hex) of every object the driver holds a reference to
        return {key.decode() if isinstance(key, bytes) else key for key in table()}

    res = echo_groups["echo"].make(_ints(5))
    res["adv"] = torch.ones(5)
    echo_groups["solo"].seen(res.padded(4, zero=["adv"]))
    ids = {ref.hex() for column in res.columns.values() for ref in column.refs if ref}
    assert len(ids) == 2 * 2 + 2 and ids <= held()  # y, id from two ranks; adv's two shards
    del res
    gc.collect()
    assert not ids & held()
