"""The Ray actor that hosts the workers of the roles colocated on one bundle.

With ``colocate="process"`` one ``WorkerHost`` runs per bundle of a pool and
each role mapped to that pool adds its worker object here, so colocated roles
share a process (and its ``torch.distributed`` group and device). With
``colocate="actor"`` each role has a host of its own per bundle, holding a
fraction of the bundle (see ``trainer/controller/colocation.py``). The driver reaches a role's method
through :meth:`WorkerHost.call` with the role name; users only ever see the
group's proxies, named after the worker methods. Parts of a resident batch
arrive as plans and are read from the object store here, before the method
runs (:mod:`trainer.controller.resident`).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import ray
import torch
from ray.exceptions import ObjectLostError

from trainer.controller import ledger
from trainer.controller.errors import InputLostError, WorkerError
from trainer.controller.rendezvous import free_port
from trainer.controller.resident import ShardPlan, keep, resolve
from trainer.controller.worker import Worker, WorkerContext, create_worker

__all__ = ["WorkerHost"]


@ray.remote(max_restarts=0, max_task_retries=0)
class WorkerHost:
    """Hosts ``{role: worker}`` in one process at a fixed rank."""

    def __init__(self, rank: int, num_threads: int | None) -> None:
        self._rank = rank
        self._workers: dict[str, Worker] = {}
        self._store_s = 0.0
        """Seconds the current call spent reading and writing resident batches."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def info(self) -> dict[str, Any]:
        """Where this process runs: pid, node, address, a free port, GPU ids."""
        port = free_port("")  # all interfaces: the other ranks connect from their nodes
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "free_port": port,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "placement_group_id": ctx.get_placement_group_id(),
            "num_threads": torch.get_num_threads(),
        }

    def add_worker(
        self, role: str, cls: type[Worker], context: WorkerContext, kwargs: dict[str, Any]
    ) -> None:
        """Construct ``role``'s worker in this process."""
        if role in self._workers:
            raise ValueError(f"role {role!r} already has a worker on rank {self._rank}")
        try:
            self._workers[role] = create_worker(cls, context, kwargs)
        except Exception:
            raise WorkerError(role, self._rank, "__init__", traceback.format_exc()) from None

    def call(self, role: str, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``role``'s ``method``; a raised exception comes back as :class:`WorkerError`.

        ``role`` and ``method`` are positional-only so that worker methods may
        take keyword arguments of those names.
        """
        try:
            t0 = time.perf_counter()
            try:
                args = tuple(resolve(a) if isinstance(a, ShardPlan) else a for a in args)
                kwargs = {
                    k: resolve(v) if isinstance(v, ShardPlan) else v for k, v in kwargs.items()
                }
            except ObjectLostError:
                raise InputLostError(role, self._rank, method, traceback.format_exc()) from None
            self._store_s += time.perf_counter() - t0
            return getattr(self._workers[role], method)(*args, **kwargs)
        except InputLostError:
            raise
        except Exception:
            raise WorkerError(role, self._rank, method, traceback.format_exc()) from None

    def timed_call(self, role: str, method: str, /, *args: Any, **kwargs: Any) -> ledger.Timed:
        """:meth:`call`, with the seconds it took here and, of those, device copies and object-store reads.

        What the role groups use: the driver's ledger subtracts the workers'
        own time from the time it waited (``trainer.controller.ledger``).
        """
        ledger.copy_seconds(reset=True)
        self._store_s = 0.0
        t0 = time.perf_counter()
        result = self.call(role, method, *args, **kwargs)
        seconds = time.perf_counter() - t0
        return ledger.Timed(result, seconds, ledger.copy_seconds(), self._store_s)

    def kept_call(self, role: str, method: str, /, *args: Any, **kwargs: Any) -> ledger.Timed:
        """:meth:`timed_call` whose TensorDict result stays here, in the object store.

        The driver gets references (:func:`trainer.controller.resident.keep`);
        a role whose dispatch spec says ``resident=True`` is called this way.
        The puts count as object-store time, with the reads.
        """
        timed = self.timed_call(role, method, *args, **kwargs)
        try:
            t0 = time.perf_counter()
            kept = keep(timed.result)
            put_s = time.perf_counter() - t0
        except Exception:
            raise WorkerError(role, self._rank, method, traceback.format_exc()) from None
        return ledger.Timed(
            kept, timed.seconds + put_s, timed.copy_seconds, timed.store_seconds + put_s
        )
