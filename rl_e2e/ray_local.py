"""A local Ray cluster sealed off from the rest of the machine, and what a test leaves in it.

:func:`local_cluster` starts a new cluster only: ``address="local"`` (never the
cluster ``RAY_ADDRESS`` or a stale address file points to; ``RAY_ADDRESS`` is
removed while it runs), its own short temp dir (Ray's socket paths must stay
under 107 bytes), no dashboard, bounded CPUs, and the given runtime env, without
the helper processes such a cluster never uses (``rl_e2e.ray_lean``). It is
shut down whatever happens, with ``ray.shutdown()`` and never ``ray stop``
(which stops every cluster on the node); a reaper (``rl_e2e.reaper``) kills
what is left of it, even after the test process was killed with SIGKILL.

Between tests of a shared cluster, :class:`Leftovers` removes the actors and
placement groups a finished test left behind (a failed test's actors would
otherwise keep their resources and hang the next test), and
:class:`WorkerLogs` gives the part of the workers' logs a test produced.
Ray is imported when these run, never at import of this module.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_e2e.coverage import WorkerCoverage, start_measuring
from rl_e2e.distributed import tail_text
from rl_e2e.ray_lean import lean_local_node
from rl_e2e.ray_startup import init_local
from rl_e2e.reaper import start_reaper

__all__ = ["Leftovers", "RayCluster", "WorkerLogs", "local_cluster", "short_temp_root"]

# Ray's unix-socket paths live under the temp dir and must stay under 107 bytes.
_MAX_TEMP_ROOT_LEN = 40
_LIVE_ACTOR_STATES = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING"})
_WORKER_NICENESS = "RAY_worker_niceness"  # each Ray worker reads it when it starts


@dataclass(frozen=True)
class RayCluster:
    """What a test needs to know about the cluster a fixture started."""

    address: str
    temp_dir: Path
    num_cpus: int
    num_gpus: int
    runtime_env: dict[str, Any] = field(repr=False)
    coverage: WorkerCoverage | None = field(default=None, repr=False)

    @property
    def logs_dir(self) -> Path:
        """Where Ray writes this cluster's process logs."""
        return self.temp_dir / "session_latest" / "logs"

    def save_coverage(self) -> None:
        """Have every measured worker save its coverage data now (nothing with coverage off).

        Called before workers are killed (leftover actors removed, shutdown):
        Ray kills them without letting them exit.
        """
        if self.coverage is not None:
            self.coverage.save()


def short_temp_root() -> str:
    """``RAY_TMPDIR`` when it is short enough for Ray's socket paths, else ``/tmp``."""
    root = os.environ.get("RAY_TMPDIR", "")
    return root if root and len(root) <= _MAX_TEMP_ROOT_LEN else "/tmp"


@contextmanager
def local_cluster(
    runtime_env: dict[str, Any],
    num_cpus: int,
    num_gpus: int = 0,
    **init_kwargs: Any,
) -> Iterator[RayCluster]:
    """Start a new local Ray with ``runtime_env``; shut it down and remove its files whatever happens.

    Its workers run at the test process's niceness unless ``RAY_worker_niceness``
    is set: at Ray's default of 15 they get a small share of a core beside the
    processes of other tests (pytest-xdist workers, gpusched's other files).

    While coverage measures this process, the workers are measured too
    (:mod:`rl_e2e.coverage`): ``runtime_env`` gets coverage's start-up variable
    on its way to ``ray.init`` (the yielded ``runtime_env`` is the one given),
    the workers save before the shutdown, and their data is merged beside the
    session's data file after it.

    A start that misses Ray's own 30 s deadline for the node to register (a
    busy machine) is stopped and started again (:mod:`rl_e2e.ray_startup`).

    Raises:
        RuntimeError: Ray is already initialised in this process (a test that
            called ``ray.init`` itself, or two cluster fixtures at once).
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process: use one e2e_ray fixture at a "
            "time, and do not call ray.init in a test that uses one"
        )
    measuring = start_measuring()
    saved_address = os.environ.pop("RAY_ADDRESS", None)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir=short_temp_root()))
    reaper = start_reaper()  # Ray's processes inherit its tag
    default_niceness = _WORKER_NICENESS not in os.environ
    os.environ.setdefault(_WORKER_NICENESS, "0")
    try:
        try:
            with lean_local_node(log_to_driver=init_kwargs.get("log_to_driver", True)):
                context = init_local(
                    lambda: ray.init(
                        address="local",  # never a cluster a crashed `ray start` recorded
                        num_cpus=num_cpus,
                        num_gpus=num_gpus,
                        include_dashboard=False,
                        runtime_env=(
                            measuring.runtime_env(runtime_env) if measuring else runtime_env
                        ),
                        _temp_dir=str(temp_dir),
                        **with_lazy_workers(init_kwargs),
                    )
                )
        finally:
            os.environ.pop(reaper.variable, None)  # the test's own children are not Ray's
            if default_niceness:
                os.environ.pop(_WORKER_NICENESS, None)
        with _saving_before_kill(measuring):
            yield RayCluster(
                address=context.address_info["gcs_address"],
                temp_dir=temp_dir,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                runtime_env=runtime_env,
                coverage=measuring,
            )
    finally:
        try:
            if measuring is not None and ray.is_initialized():
                measuring.save()
        finally:
            ray.shutdown()
            reaper.close()  # and anything of the cluster that outlived the shutdown
            shutil.rmtree(temp_dir, ignore_errors=True)
            if saved_address is not None:
                os.environ["RAY_ADDRESS"] = saved_address
            if measuring is not None:
                measuring.merge()


def with_lazy_workers(init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``init_kwargs`` with Ray's prestart of idle workers for the first driver turned off,
    unless the caller's ``_system_config`` says otherwise.

    By default Ray starts idle workers (up to one per core of the machine) as
    soon as the test process connects. Tests mostly create actors, which start
    workers of their own, so those idle ones cost CPU while the cluster starts
    and serve nothing: about a core-second a cluster on a 2-core machine.
    """
    system_config = {"prestart_worker_first_driver": False, **init_kwargs.get("_system_config", {})}
    return {**init_kwargs, "_system_config": system_config}


@contextmanager
def _saving_before_kill(measuring: WorkerCoverage | None) -> Iterator[None]:
    """While the cluster is measured, ``ray.kill`` has the measured workers save first.

    Ray kills an actor's process without letting it exit, so what it measured
    since its last save would be lost: a trainer shutting its worker groups down
    with ``ray.kill`` in the middle of a test lost them, unless another test's
    leftovers happened to make everyone save before.
    """
    if measuring is None:
        yield
        return
    import ray

    original = ray.kill

    @functools.wraps(original)
    def kill(*args: Any, **kwargs: Any) -> None:
        measuring.save()
        original(*args, **kwargs)

    ray.kill = kill
    try:
        yield
    finally:
        ray.kill = original


@dataclass(frozen=True)
class Leftovers:
    """The live actors and placement groups of the cluster when a test started."""

    actors: frozenset[str]
    placement_groups: frozenset[str]

    @classmethod
    def snapshot(cls) -> Leftovers:
        """What lives in the connected cluster now."""
        actors, groups = _live_actors(), _live_placement_groups()
        return cls(frozenset(actors), frozenset(groups))

    def remove_new(self, before_kill: Callable[[], object] | None = None) -> list[str]:
        """Kill the actors and remove the placement groups created since the snapshot.

        ``before_kill`` is called once before the first actor is killed (the
        plugin has the workers save their coverage data). Returns one line for
        each thing removed (``actor Probe 5f3a...``), so the report can say what
        a test left behind.
        """
        import ray
        from ray._raylet import ActorID, PlacementGroupID
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        removed = []
        worker = ray._private.worker.global_worker
        new_actors = {
            actor_id: class_name
            for actor_id, class_name in _live_actors().items()
            if actor_id not in self.actors
        }
        if new_actors and before_kill is not None:
            before_kill()
        for actor_id, class_name in sorted(new_actors.items()):
            # What ray.kill does with a handle; a test's handle may be gone.
            worker.core_worker.kill_actor(ActorID.from_hex(actor_id), True)
            removed.append(f"actor {class_name} {actor_id}")
        for group_id in sorted(_live_placement_groups()):
            if group_id not in self.placement_groups:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
                removed.append(f"placement group {group_id}")
        return removed


def _live_actors() -> dict[str, str]:
    from ray._private import state

    return {
        actor_id: str(info.get("ActorClassName") or "?")
        for actor_id, info in state.actors().items()
        if info.get("State") in _LIVE_ACTOR_STATES
    }


def _live_placement_groups() -> set[str]:
    import ray

    return {
        group_id
        for group_id, info in ray.util.placement_group_table().items()
        if info.get("state") != "REMOVED"
    }


@dataclass
class WorkerLogs:
    """The size of each worker log of a cluster when a test started, to read what it added."""

    logs_dir: Path
    offsets: dict[Path, int] = field(default_factory=dict)

    def mark(self) -> None:
        """Remember where every worker log ends now."""
        self.offsets = {path: _size(path) for path in self._files()}

    def _files(self) -> list[Path]:
        return sorted([*self.logs_dir.glob("worker-*.out"), *self.logs_dir.glob("worker-*.err")])

    def since_mark(self, max_bytes: int) -> str:
        """What the workers wrote since :meth:`mark`, at most ``max_bytes`` (the latest kept)."""
        parts = []
        for path in self._files():
            start = self.offsets.get(path, 0)
            size = _size(path)
            if size <= start:
                continue
            text = tail_text(path, min(size - start, max_bytes))
            if text.strip():
                parts.append(f"--- {path.name} ---\n{text.rstrip()}")
        joined = "\n".join(parts)
        if len(joined) > max_bytes:
            joined = (
                f"[... {len(joined) - max_bytes} characters left out ...]\n" + joined[-max_bytes:]
            )
        return joined


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
