"""The ``Worker`` base class: rank, world size, rendezvous address, dispatch table.

A worker class declares which of its methods the driver may call and how::

    class CriticWorker(Worker):
        dispatch = {
            "init_model": Dispatch.ONE_TO_ALL,
            "compute_values": Dispatch.DP_SPLIT,
            "state_dict": Dispatch.RANK_ZERO,
        }

The table is checked when the class statement runs (so a typo fails at
import), normalised to ``{name: DispatchSpec}`` and merged with the tables of
the base classes. The worker group builds its proxies from it and from nothing
else.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from trainer.controller.grant import granted_backend
from trainer.controller.modes import DispatchSpec, as_spec
from trainer.controller.rendezvous import default_backend, free_port

__all__ = ["Worker", "WorkerContext", "create_worker"]


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker sits in its group; set by the group before ``__init__`` runs."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    role: str = ""


class Worker:
    """Base class of every role's worker (actor, critic, rollout, reference).

    ``self.rank``, ``self.world_size``, ``self.master_addr``, ``self.master_port``
    and ``self.role`` are set when a subclass ``__init__`` runs (which calls
    ``super().__init__()`` with no arguments). A worker built directly, outside
    a group, is rank 0 of a world of 1.
    """

    dispatch: ClassVar[MappingProxyType[str, DispatchSpec]] = MappingProxyType({})
    _context: WorkerContext = WorkerContext()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("dispatch", {})
        if not isinstance(own, (dict, MappingProxyType)):
            raise TypeError(
                f"{cls.__qualname__}.dispatch must be a dict of method name -> Dispatch, "
                f"got {type(own).__name__}"
            )
        table: dict[str, DispatchSpec] = {}
        for base in reversed(cls.__mro__[1:]):
            table.update(getattr(base, "dispatch", {}))
        for name, entry in own.items():
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
                raise TypeError(
                    f"{cls.__qualname__}.dispatch: {name!r} is not a public method name"
                )
            if not inspect.isfunction(inspect.getattr_static(cls, name, None)):
                raise AttributeError(
                    f"{cls.__qualname__}.dispatch names {name!r}, which is not a method of "
                    f"{cls.__qualname__}"
                )
            try:
                table[name] = as_spec(entry)
            except TypeError as error:
                raise TypeError(f"{cls.__qualname__}.dispatch[{name!r}]: {error}") from None
        cls.dispatch = MappingProxyType(table)

    def __init__(self) -> None:
        pass

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def master_addr(self) -> str:
        return self._context.master_addr

    @property
    def master_port(self) -> int:
        return self._context.master_port

    @property
    def role(self) -> str:
        return self._context.role

    def init_distributed(self, backend: str | None = None) -> None:
        """Bring up the default ``torch.distributed`` process group of this group.

        ``backend`` defaults to NCCL when Ray granted this worker GPU ids and
        gloo when it granted none, whatever CUDA shows (outside Ray: NCCL when
        CUDA is available).
        Idempotent: roles colocated in one process share one process group, so
        the second call is a no-op (the world sizes must agree).
        """
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(
                    f"{self.role or type(self).__name__}: torch.distributed is already up with "
                    f"world size {dist.get_world_size()}, this worker expects {self.world_size}"
                )
            return
        if self.world_size > 1 and not self.master_port:
            raise RuntimeError(
                f"{self.role or type(self).__name__}: rank {self.rank} of {self.world_size} has no "
                "master_port; workers of a group get one from create_role_groups"
            )
        backend = backend or granted_backend() or default_backend()
        port = self.master_port or free_port(self.master_addr)
        if backend == "nccl":
            torch.cuda.set_device(0)
        # For libraries that read the usual variables; this process is this rank's own.
        os.environ.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{port}",
            rank=self.rank,
            world_size=self.world_size,
        )


def create_worker(cls: type[Worker], context: WorkerContext, kwargs: dict[str, Any]) -> Worker:
    """Construct ``cls(**kwargs)`` with ``context`` already in place for its ``__init__``."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"worker class must be a subclass of Worker, got {cls!r}")
    worker = cls.__new__(cls)
    worker._context = context
    worker.__init__(**kwargs)
    return worker
