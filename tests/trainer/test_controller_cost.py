"""The controller's cost, measured per call on a real local Ray cluster: bytes and seconds.

A role group of two ranks on the e2e plugin's cluster; each call runs inside
a :class:`~trainer.controller.ledger.Ledger` and the test compares what it
recorded with what the test itself sent, received and made the workers do.
The same figures per step, written to ``metrics.jsonl`` by ``python -m
trainer``, are checked in ``test_main.py``.
"""

from __future__ import annotations

import sys
import time

import pytest
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

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file

NAP_S = 0.3  # what each rank's method spends in the worker


class EchoWorker(Worker):
    dispatch = {
        "double": Dispatch.DP_SPLIT,
        "nap": Dispatch.ONE_TO_ALL,
        "nap_later": DispatchSpec(Dispatch.ONE_TO_ALL, blocking=False),
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


@pytest.fixture(scope="module")
def echo_group(e2e_ray):
    manager = ResourcePoolManager({"pool": ResourcePool([2])}, {"echo": "pool"})
    groups = create_role_groups(manager, {"echo": (EchoWorker, {})})
    try:
        yield groups["echo"]
    finally:
        groups["echo"].shutdown()
        groups["echo"].pool.release()


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
