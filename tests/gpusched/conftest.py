"""Helpers for gpusched tests: write a suite into a temp dir, run pytest or gpusched on it for real."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from deadlines import hang_guard


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without gpusched's settings; no real card is visible
    (``CUDA_VISIBLE_DEVICES=""``), so a run finds the same cards on a GPU machine as here.
    Without coverage's variables either: a suite run here measures into its own data file,
    never into this test's (when this suite runs under coverage)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSCHED_", "CUDA_VISIBLE", "COVERAGE_"))
    }
    env.pop("PYTEST_ADDOPTS", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@pytest.fixture
def make_suite(tmp_path: Path):
    """Write ``{relative path: source}`` under tmp_path (sources are dedented)."""

    def write(files: dict[str, str]) -> Path:
        for name, source in files.items():
            target = tmp_path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(source))
        return tmp_path

    return write


@pytest.fixture
def run_pytest(tmp_path: Path):
    """Plain ``python -m pytest`` in the suite dir (the plugin loads through its entry point)."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
            cwd=tmp_path,
            env=_clean_env(**env),
            capture_output=True,
            text=True,
            timeout=hang_guard(120),
        )

    return run


@pytest.fixture
def run_gpusched(tmp_path: Path):
    """The real ``gpusched`` command as a subprocess in the suite dir (``via``: the python
    arguments that start it, e.g. ``("-c", source)`` for a wrapper that patches something)."""

    def run(
        *args: str, timeout: float = 120, via: tuple[str, ...] = ("-m", "gpusched"), **env: str
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *via, *args],
            cwd=tmp_path,
            env=_clean_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
