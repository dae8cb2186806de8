"""End-to-end fixtures: Ray with the trainer's production runtime env, and N-rank process groups.

Fixtures (scope in brackets):

- ``ray_cluster`` [module]: a local Ray started with ``get_runtime_env()`` and
  bounded CPUs, ``RAY_ADDRESS`` removed, a short temp dir; always shut down.
  Per-module overrides by indirect parametrization, e.g.
  ``@pytest.mark.parametrize("ray_cluster", [{"num_cpus": 4}], indirect=True)``;
  keys: ``num_cpus``, ``num_gpus``, ``host_env`` (extra host variables the
  runtime env is composed from, as if set on the driver's host) and any other
  ``ray.init`` keyword. A parameter with ``num_gpus`` skips without CUDA (mark
  it ``gpu1``/``gpu2`` so gpusched gives it cards), so one module can run the
  same tests on CPU and on GPUs, one cluster at a time.
- ``ray_host_env`` [module]: host variables added to every cluster's
  ``host_env`` in a module (default none); override it in a test module when a
  value is only known at run time (a temp path).
- ``ray_cluster_gpu1`` / ``ray_cluster_gpu2`` [module]: the same with 1 / 2 GPUs,
  marked ``gpu1`` / ``gpu2`` at collection (so gpusched schedules them), skipped
  when CUDA or enough cards are missing.
- ``distributed`` [function]: ``distributed(fn, world_size, *args)`` runs
  ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes inside a
  gloo process group (``trainer.distributed.run_distributed``) and returns the
  per-rank results; a rank's exception is re-raised naming the rank.
- ``distributed_gpu1`` / ``distributed_gpu2``: the same over NCCL, marked and
  skipped like the GPU clusters.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trainer.runtime_env import get_runtime_env

DEFAULT_NUM_CPUS = 2
# Ray's unix-socket paths live under the temp dir and must stay under 107 bytes.
_MAX_TEMP_ROOT_LEN = 40


@dataclass(frozen=True)
class RayCluster:
    """What a test needs to know about the cluster a fixture started."""

    address: str
    temp_dir: Path
    num_cpus: int
    num_gpus: int
    runtime_env: dict[str, Any] = field(repr=False)


def _short_temp_root() -> str:
    root = os.environ.get("RAY_TMPDIR", "")
    return root if root and len(root) <= _MAX_TEMP_ROOT_LEN else "/tmp"


@contextmanager
def _ray_start(
    num_cpus: int = DEFAULT_NUM_CPUS,
    num_gpus: int = 0,
    host_env: Mapping[str, str] | None = None,
    **init_kwargs: Any,
) -> Iterator[RayCluster]:
    """Start a local Ray with the production runtime env; stop it whatever happens.

    ``host_env`` is layered over ``os.environ`` when composing the runtime env
    only (the raylet itself inherits ``os.environ``), so a test sees exactly what
    the runtime env carries to the workers.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process; a test module may use one "
            "ray_cluster fixture at a time (and must not call ray.init itself)"
        )
    saved_address = os.environ.pop("RAY_ADDRESS", None)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir=_short_temp_root()))
    try:
        runtime_env = get_runtime_env({**os.environ, **(host_env or {})})
        context = ray.init(
            address="local",  # never a cluster a crashed `ray start` recorded
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            _temp_dir=str(temp_dir),
            **init_kwargs,
        )
        yield RayCluster(
            address=context.address_info["gcs_address"],
            temp_dir=temp_dir,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            runtime_env=runtime_env,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_address is not None:
            os.environ["RAY_ADDRESS"] = saved_address


def _overrides(request: pytest.FixtureRequest, host_env: Mapping[str, str]) -> dict[str, Any]:
    """A copy of the indirect parameter (never mutated), with the module's host env merged in."""
    param = getattr(request, "param", None)
    if param is None:
        param = {}
    if not isinstance(param, Mapping):
        raise TypeError(
            f"{request.fixturename}: indirect parameter must be a dict of _ray_start "
            f"overrides, got {type(param).__name__}: {param!r}"
        )
    overrides = dict(param)
    overrides["host_env"] = {**host_env, **dict(overrides.get("host_env") or {})}
    return overrides


def _require_cuda(n_gpus: int) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"needs {n_gpus} CUDA GPU(s): torch.cuda.is_available() is False")
    visible = torch.cuda.device_count()
    if visible < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA GPU(s), {visible} visible")


@pytest.fixture(scope="module")
def ray_host_env() -> dict[str, str]:
    """Host variables added to the runtime env of every cluster in the module (none)."""
    return {}


@pytest.fixture(scope="module")
def ray_cluster(
    request: pytest.FixtureRequest, ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """A module-scoped local Ray cluster started with the production runtime env.

    An override asking for GPUs (``{"num_gpus": 2}``, with a ``gpu2`` mark on
    its ``pytest.param``) skips before Ray starts when CUDA or cards are missing.
    """
    overrides = _overrides(request, ray_host_env)
    if overrides.get("num_gpus"):
        _require_cuda(int(overrides["num_gpus"]))
    with _ray_start(**overrides) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.gpu1, id="gpu1")])
def ray_cluster_gpu1(
    request: pytest.FixtureRequest, ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """``ray_cluster`` with one GPU; skipped without CUDA."""
    _require_cuda(1)
    with _ray_start(**{"num_gpus": 1, **_overrides(request, ray_host_env)}) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.gpu2, id="gpu2")])
def ray_cluster_gpu2(
    request: pytest.FixtureRequest, ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """``ray_cluster`` with two GPUs; skipped without two CUDA cards."""
    _require_cuda(2)
    with _ray_start(**{"num_gpus": 2, **_overrides(request, ray_host_env)}) as cluster:
        yield cluster


@dataclass(frozen=True)
class DistributedRunner:
    """Callable returned by the ``distributed`` fixtures; see ``run_distributed``."""

    backend: str
    max_world_size: int | None = None

    def __call__(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results."""
        from trainer.distributed import run_distributed

        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ValueError(
                f"world_size={world_size} exceeds the {self.max_world_size} GPU(s) "
                f"this fixture was marked for"
            )
        return run_distributed(fn, world_size, *args, backend=self.backend, timeout_s=timeout_s)


@pytest.fixture
def distributed() -> DistributedRunner:
    """Run a function on N CPU processes joined in a gloo process group."""
    return DistributedRunner(backend="gloo")


@pytest.fixture(params=[pytest.param(1, marks=pytest.mark.gpu1, id="gpu1")])
def distributed_gpu1() -> DistributedRunner:
    """``distributed`` over NCCL on one GPU; skipped without CUDA."""
    _require_cuda(1)
    return DistributedRunner(backend="nccl", max_world_size=1)


@pytest.fixture(params=[pytest.param(2, marks=pytest.mark.gpu2, id="gpu2")])
def distributed_gpu2() -> DistributedRunner:
    """``distributed`` over NCCL on two GPUs; skipped without two CUDA cards."""
    _require_cuda(2)
    return DistributedRunner(backend="nccl", max_world_size=2)
