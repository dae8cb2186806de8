"""Ray for the trainer's tests: one local cluster per module, small and always shut down.

Fixtures (scope in brackets):

- ``ray_init_kwargs`` [module]: the ``ray.init`` keywords of the module's
  cluster on top of the defaults (2 CPUs, no dashboard); override it in a
  test module that needs more, e.g. ``return {"num_cpus": 5}``.
- ``ray_shared`` [module]: a local Ray started with those keywords, shut
  down when the module ends even if a test or the start itself failed.
- ``trainer_cli`` [module]: runs ``python -m trainer ARGS`` as a user would,
  in an environment with its own model cache (the tiny model built once) and
  a short ``RAY_TMPDIR``, removed when the module ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deadlines import hang_guard

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def _ray_start(**overrides: Any) -> Iterator[None]:
    """Start a local Ray with small defaults and ``overrides``; stop it whatever happens."""
    import ray

    # "local": never the cluster a crashed `ray start` recorded in ray_current_cluster.
    ray.init(**{"address": "local", "num_cpus": 2, "include_dashboard": False, **overrides})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_init_kwargs() -> dict[str, Any]:
    """Extra ``ray.init`` keywords of the module's cluster (none)."""
    return {}


@pytest.fixture(scope="module")
def ray_shared(ray_init_kwargs: dict[str, Any]) -> Iterator[None]:
    """A module-scoped local Ray cluster; see ``ray_init_kwargs``."""
    with _ray_start(**ray_init_kwargs):
        yield


@pytest.fixture(scope="module")
def trainer_cli(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``trainer_cli(*args, timeout=hang_guard(240), env=None)``: one ``python -m trainer`` subprocess,
    output captured; ``env`` adds to (or overrides) its environment."""
    from trainer.models import ensure_tiny_model

    cache = tmp_path_factory.mktemp("cache")
    ensure_tiny_model(cache_dir=cache)
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray socket paths must stay short
    base_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base_env.update(TRAINER_CACHE=str(cache), RAY_TMPDIR=ray_tmp, PYTHONPATH=str(REPO))

    def run(
        *args: str, timeout: float = hang_guard(240), env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "trainer", *args],
            env={**base_env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    try:
        yield run
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
