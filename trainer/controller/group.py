"""Role groups: one handle per role whose methods are built from the dispatch table.

``create_role_groups(manager, {"actor": (ActorWorker, {...}), "critic":
(CriticWorker, {...})})`` reserves the manager's pools, starts one
:class:`~trainer.controller.host.WorkerHost` per bundle (shared by every role
on that pool; with ``colocate="actor"`` one per role and bundle, each with a
fraction of the bundle), constructs each role's worker in those hosts, and
returns ``{role: RoleGroup}``. ``groups["critic"].compute_values(batch)`` then splits
``batch`` as ``CriticWorker.dispatch`` says, runs on every rank and collects.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainer.controller import ledger
from trainer.controller.colocation import ColocateMode, plan_hosts
from trainer.controller.dispatch import collect_results, split_call
from trainer.controller.errors import WorkerDiedError, WorkerError
from trainer.controller.host import WorkerHost
from trainer.controller.modes import DispatchSpec
from trainer.controller.resources import RayResourcePool, ResourcePoolManager
from trainer.controller.worker import Worker, WorkerContext

__all__ = ["PendingCall", "RoleGroup", "create_role_groups"]

DEATH_GRACE_S = 2.0
"""After a rank fails, how long the driver waits for the others before naming one."""


def _fetch_one(ref: Any, rank: int, role: str, method: str) -> Any:
    try:
        return ray.get(ref)
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, WorkerError):  # its own class: InputLostError is told apart
            raise type(cause)(
                cause.role, cause.rank, cause.method, cause.remote_traceback
            ) from None
        raise WorkerError(role, rank, method, str(error)) from None
    except RayActorError as error:
        raise WorkerDiedError(role, rank, method, str(error).strip()) from None


def _gather(refs: Sequence[Any], ranks: Sequence[int], role: str, method: str) -> list[Any]:
    """Results of ``refs`` in order; on failure, raises naming the failing rank.

    ``ray.get`` of a list returns early as soon as one object is an error, so
    a rank that fails while the others block in a collective is reported at
    once instead of hanging the driver. The failing rank is then found among
    the results available within :data:`DEATH_GRACE_S`: a rank whose process
    died is named before ranks whose collectives failed because of it (their
    "connection reset" can reach the driver before Ray reports the death).
    """
    try:
        return ray.get(list(refs))
    except (RayTaskError, RayActorError):
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=DEATH_GRACE_S)
        finished = set(ready)
        errors: list[WorkerError] = []
        for ref, rank in zip(refs, ranks, strict=True):
            if ref in finished:
                try:
                    _fetch_one(ref, rank, role, method)
                except WorkerDiedError:
                    raise
                except WorkerError as error:
                    errors.append(error)
        if errors:
            raise errors[0] from None
        raise


class PendingCall:
    """The result of a non-blocking call; ``.get()`` waits for it."""

    def __init__(self, finish: Callable[[], Any], refs: Sequence[Any] = ()) -> None:
        self._finish = finish
        self._refs = list(refs)

    def ready(self) -> bool:
        """Whether every rank has finished (``.get()`` would not wait)."""
        return self.wait(0)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every rank to finish; whether they all have."""
        if not self._refs:
            return True
        done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=timeout_s)
        return len(done) == len(self._refs)

    def get(self) -> Any:
        """Wait for every rank and return what the blocking call would have returned."""
        return self._finish()


class RoleGroup:
    """The driver's handle on one role's workers, one per rank.

    For every entry ``name`` of the worker class's dispatch table the group
    has an attribute ``name``: a function with the worker method's name,
    docstring and signature (without ``self``) that splits, runs and collects
    as the table says.
    """

    def __init__(
        self, role: str, worker_cls: type[Worker], hosts: Sequence[Any], pool: RayResourcePool
    ) -> None:
        self.role = role
        self.worker_cls = worker_cls
        self.hosts = list(hosts)
        self.pool = pool
        for name, spec in worker_cls.dispatch.items():
            setattr(self, name, _make_proxy(self, name, spec))

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def call(self, name: str, spec: DispatchSpec, args: tuple, kwargs: dict) -> Any:
        """Run ``name`` under ``spec``; the proxies call this.

        Its costs (time to split and submit, to wait, to join; the workers' own
        seconds; tensor bytes each way) go to the open ledger, if any
        (:mod:`trainer.controller.ledger`).
        """
        t0 = time.perf_counter()
        split = split_call(spec.mode, self.world_size, args, kwargs, f"{self.role}.{name}")
        refs = [
            getattr(self.hosts[rank], "kept_call" if spec.resident else "timed_call").remote(
                self.role, name, *split.args[i], **split.kwargs[i]
            )
            for i, rank in enumerate(split.ranks)
        ]
        ledger.record_submit(time.perf_counter() - t0, [*split.args, *split.kwargs])

        def finish() -> Any:
            t1 = time.perf_counter()
            timed = _gather(refs, split.ranks, self.role, name)
            t2 = time.perf_counter()
            result = collect_results(
                spec.mode, [t.result for t in timed], split.pad_size, split.real_rows
            )
            ledger.record_finish(t2 - t1, time.perf_counter() - t2, timed)
            return result

        return finish() if spec.blocking else PendingCall(finish, refs)

    def shutdown(self) -> None:
        """Kill this group's processes (with ``colocate="process"``, shared with the roles on its pool)."""
        for host in self.hosts:
            ray.kill(host, no_restart=True)

    def __repr__(self) -> str:
        return f"RoleGroup(role={self.role!r}, worker={self.worker_cls.__qualname__}, world_size={self.world_size})"


def _make_proxy(group: RoleGroup, name: str, spec: DispatchSpec) -> Callable[..., Any]:
    method = getattr(group.worker_cls, name)

    def proxy(*args: Any, **kwargs: Any) -> Any:
        return group.call(name, spec, args, kwargs)

    functools.update_wrapper(proxy, method)
    # Tracebacks print the code object's name, not __name__.
    code = proxy.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=f"{group.worker_cls.__qualname__}.{name}")
    proxy.__code__ = code
    signature = inspect.signature(method)
    params = list(signature.parameters.values())[1:]
    proxy.__signature__ = inspect.Signature(params, return_annotation=signature.return_annotation)
    return proxy


def _check_specs(
    manager: ResourcePoolManager, specs: Mapping[str, tuple[type[Worker], dict]]
) -> None:
    for role, spec in specs.items():
        if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping)):
            raise TypeError(f"specs[{role!r}] must be (WorkerClass, kwargs dict), got {spec!r}")
        cls = spec[0]
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"specs[{role!r}]: {cls!r} is not a Worker subclass")
        manager.pool_of(role)
        clashes = sorted(name for name in cls.dispatch if hasattr(RoleGroup, name))
        if clashes:
            raise ValueError(
                f"{cls.__qualname__}.dispatch names {clashes}, which RoleGroup itself uses; rename them"
            )


def create_role_groups(
    manager: ResourcePoolManager,
    specs: Mapping[str, tuple[type[Worker], dict[str, Any]]],
    *,
    colocate: ColocateMode = "process",
    runtime_env: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> dict[str, RoleGroup]:
    """Start the workers of every role and return one :class:`RoleGroup` per role.

    Rank ``i`` of a role runs in bundle ``i`` of its pool; roles on different
    pools never share a process or a bundle. ``colocate`` says how the ``k``
    roles mapped to one pool share its bundles:

    * ``"process"`` (default): one :class:`WorkerHost` per bundle, holding the
      whole bundle, hosts all ``k`` roles: one process, one device, one
      ``torch.distributed`` group (one rendezvous address per pool).
    * ``"actor"``: every role gets its own :class:`WorkerHost` in each bundle,
      asking for ``1/k`` of the bundle's GPUs and CPUs, so rank ``i`` of each
      role shares bundle ``i``'s card in a process of its own, with its own
      rendezvous address and process group.

    The roles' handles are the same in both modes. Workers are constructed
    in ``specs`` order, all ranks of a role at once, with ``rank``,
    ``world_size``, ``master_addr`` and ``master_port`` already set.
    """
    _check_specs(manager, specs)
    host_sets = plan_hosts({role: manager.pool_of(role) for role in specs}, manager.pools, colocate)
    reserved = manager.reserve(timeout_s=timeout_s)
    hosts: list[list[Any]] = []
    try:
        for host_set in host_sets:
            pool = reserved[host_set.pool]
            hosts.append(
                [
                    WorkerHost.options(
                        num_cpus=host_set.num_cpus,
                        num_gpus=host_set.num_gpus,
                        runtime_env=dict(runtime_env) if runtime_env else None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=index
                        ),
                    ).remote(rank, pool.pool.num_threads)
                    for rank, (pg, index) in enumerate(pool.bundles())
                ]
            )
        rank0 = [
            _gather([h.info.remote() for h in hs], range(len(hs)), "+".join(s.roles), "info")[0]
            for s, hs in zip(host_sets, hosts, strict=True)
        ]
        set_of = {role: i for i, s in enumerate(host_sets) for role in s.roles}
        groups = {}
        pending = []
        for role, (cls, kwargs) in specs.items():
            i = set_of[role]
            hs = hosts[i]
            address, port = rank0[i]["address"], rank0[i]["free_port"]
            refs = [
                host.add_worker.remote(
                    role, cls, WorkerContext(rank, len(hs), address, port, role), dict(kwargs)
                )
                for rank, host in enumerate(hs)
            ]
            pending.append((refs, role))
            groups[role] = RoleGroup(role, cls, hs, reserved[host_sets[i].pool])
        for refs, role in pending:
            _gather(refs, range(len(refs)), role, "__init__")
        return groups
    except BaseException:
        for hs in hosts:
            for host in hs:
                ray.kill(host, no_restart=True)
        for pool in reserved.values():  # else the failed start holds the cluster's resources
            pool.release()
        raise
