"""Ray for the trainer's tests: one local cluster per module, small and always shut down.

Fixtures (scope in brackets):

- ``ray_init_kwargs`` [module]: the ``ray.init`` keywords of the module's
  cluster on top of the defaults (2 CPUs, no dashboard); override it in a
  test module that needs more, e.g. ``return {"num_cpus": 5}``.
- ``ray_shared`` [module]: a local Ray started with those keywords, shut
  down when the module ends even if a test or the start itself failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def _ray_start(**overrides: Any) -> Iterator[None]:
    """Start a local Ray with small defaults and ``overrides``; stop it whatever happens."""
    import ray

    ray.init(**{"num_cpus": 2, "include_dashboard": False, **overrides})
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
