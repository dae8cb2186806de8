"""Fixtures of the trainer's tests: Ray from the e2e plugin, and the command line.

Fixtures (scope in brackets):

- Ray clusters come from the e2e plugin (``e2e_ray``, ``rl_e2e.plugin``), as
  in any repository that uses it; a module that needs more than its defaults
  overrides ``e2e_ray_options``, e.g. ``return {"num_cpus": 5}``.
- ``trainer_cli`` [module]: runs ``python -m trainer ARGS`` as a user would,
  in an environment with its own model cache (the tiny model built once) and
  a short ``RAY_TMPDIR``, removed when the module ends.

The ranks of ``run_distributed`` here run the trainer's worker code, so their
fork server imports what a warm Ray worker gets (``WARM_PRELOAD``: tensordict,
transformers' model classes, FSDP, DCP) once per test file, not once per rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from deadlines import hang_guard

from rl_e2e.distributed import set_rank_preload
from trainer.launch.runtime_env import WARM_PRELOAD

REPO = Path(__file__).resolve().parents[2]

set_rank_preload(WARM_PRELOAD)


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
