"""What the single controller costs, step by step: the driver's time in worker calls, bytes moved.

A step's wall time splits into three parts that add up:

* the driver's own math (rewards, advantages, metrics): time outside any call
  to a worker group;
* the workers' compute on the step's critical path: for each call, the
  slowest rank's time inside the worker method (ranks run in parallel), as
  far as the driver waited for it;
* the controller: everything else the driver spends in calls: splitting and
  serializing arguments and submitting them (``serialize``), waiting beyond
  the workers' compute for Ray's scheduling, transfers and the results'
  deserialization (``latency``), and joining the per-rank results
  (``serialize`` too).

:class:`~trainer.controller.group.RoleGroup` records every call into the
ledger that is open in this process (:meth:`Ledger.start`); the driver's
step opens one and reads :meth:`Ledger.metrics` at its end. A call that
returns at once (``blocking=False``) is counted where the driver spends its
time: the submission in the step that made it, the wait in the step that
collects it. With no ledger open, recording costs nothing.

Inside a worker, :func:`move` is how batches go to and from the device: it
times the copy, and :meth:`WorkerHost.timed_call
<trainer.controller.host.WorkerHost.timed_call>` sends that time back with the
method's own, so the profile can show host<->device copies apart.

Bytes are the tensors' bytes (``nbytes``) of what the driver sends (every
rank's arguments, the columns it puts into a resident batch) and receives
(every rank's results, the columns it reads from a resident batch): what
crosses between the driver's process and the workers' and object store
(:mod:`trainer.controller.resident`). Reading a resident column counts as
waiting (``latency``), putting one as ``serialize``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["Ledger", "Timed", "copy_seconds", "move", "tensor_bytes"]

_open: Ledger | None = None
"""The ledger that records this process's calls now (the driver's current step), if any."""

_copy_s = 0.0
"""Seconds this worker process has spent in :func:`move` since the current call began."""


@dataclass(frozen=True)
class Timed:
    """A worker method's result with the seconds it took in the worker, and of those the copies'.

    ``store_seconds``: of ``seconds``, the time spent reading the call's
    resident arguments from Ray's object store and putting a resident result
    there: moving data, which the ledger counts as the controller's
    (``latency``), not as the workers' compute.
    """

    result: Any
    seconds: float
    copy_seconds: float
    store_seconds: float = 0.0


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, a TensorDict, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, TensorDictBase):
        return sum(t.nbytes for t in value.values(include_nested=True, leaves_only=True))
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, Timed):
        return tensor_bytes(value.result)
    resident = getattr(value, "tensor_bytes", None)  # a resident batch knows its own
    return resident() if callable(resident) else 0


def move(value: Any, device: torch.device | str) -> Any:
    """``value.to(device)``, timed as a host<->device copy of this worker process."""
    global _copy_s
    t0 = time.perf_counter()
    try:
        return value.to(device)
    finally:
        _copy_s += time.perf_counter() - t0


def copy_seconds(reset: bool = False) -> float:
    """Seconds spent in :func:`move` in this process since the last reset; ``reset`` starts over."""
    global _copy_s
    seconds = _copy_s
    if reset:
        _copy_s = 0.0
    return seconds


class Ledger:
    """The costs of the worker calls of one step, recorded by the role groups while it is open."""

    def __init__(self) -> None:
        self.calls = 0
        self.serialize_s = 0.0  # split + submit (Ray serializes the arguments) + join results
        self.wait_s = 0.0  # blocked in ray.get
        self.compute_s = 0.0  # the slowest rank's time in the method, as far as it was waited for
        self.copy_s = 0.0  # of which host<->device copies (the slowest rank's)
        self.sent_bytes = 0
        self.received_bytes = 0

    def start(self) -> Ledger:
        """Start over and record this process's calls here (until another ledger starts)."""
        global _open
        self.__init__()
        _open = self
        return self

    def stop(self) -> None:
        """Stop recording (this ledger keeps what it has)."""
        global _open
        if _open is self:
            _open = None

    def metrics(self, step_s: float) -> dict[str, float]:
        """The step's figures, ``step_s`` being its wall time.

        ``timing/controller`` = ``timing/serialize`` + ``timing/call_latency``
        and ``timing/driver_math`` = ``step_s`` - controller - ``timing/worker_compute``;
        each is >= 0 and the controller is at most the step.
        """
        waited = self.compute_s
        latency = max(0.0, self.wait_s - waited)
        controller = min(step_s, self.serialize_s + latency)
        return {
            "timing/controller": controller,
            "timing/serialize": self.serialize_s,
            "timing/call_latency": latency,
            "timing/worker_compute": waited,
            "timing/copies": min(self.copy_s, waited),
            "timing/driver_math": max(0.0, step_s - controller - waited),
            "perf/driver_bytes": float(self.sent_bytes + self.received_bytes),
            "perf/driver_bytes_sent": float(self.sent_bytes),
            "perf/driver_bytes_received": float(self.received_bytes),
            "perf/worker_calls": float(self.calls),
        }


def record_submit(seconds: float, sent: Iterable[Any]) -> None:
    """A call was split and submitted in ``seconds``; ``sent``: every rank's arguments."""
    ledger = _open
    if ledger is None:
        return
    ledger.calls += 1
    ledger.serialize_s += seconds
    ledger.sent_bytes += sum(tensor_bytes(a) for a in sent)


def record_fetch(seconds: float, received: int) -> None:
    """The driver read ``received`` tensor bytes of a resident batch from the object store."""
    ledger = _open
    if ledger is not None:
        ledger.wait_s += seconds
        ledger.received_bytes += received


def record_put(seconds: float, sent: int) -> None:
    """The driver put ``sent`` tensor bytes into a resident batch (a column it made)."""
    ledger = _open
    if ledger is not None:
        ledger.serialize_s += seconds
        ledger.sent_bytes += sent


def record_finish(wait_s: float, join_s: float, results: list[Timed]) -> None:
    """A call's results came back after ``wait_s`` blocked, joined in ``join_s``."""
    ledger = _open
    if ledger is None:
        return
    ledger.wait_s += wait_s
    ledger.serialize_s += join_s
    if results:
        ledger.compute_s += min(wait_s, max(r.seconds - r.store_seconds for r in results))
        ledger.copy_s += max(r.copy_seconds for r in results)
    ledger.received_bytes += sum(tensor_bytes(r.result) for r in results)
