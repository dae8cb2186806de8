"""One version for both commands: pyproject.toml's, as installed (``importlib.metadata``)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from deadlines import hang_guard

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard(30)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    return done.stdout


def _gpusched() -> list[str]:
    """The ``gpusched`` entry point beside this interpreter (``python -m gpusched`` without one)."""
    script = Path(sys.executable).with_name("gpusched")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpusched"]


def test_both_commands_print_the_installed_version():
    installed = metadata.version("pytest-gpusched")
    assert _run(*_gpusched(), "--version") == f"gpusched {installed}\n"
    trainer = _run(sys.executable, "-m", "trainer", "--version")
    assert trainer == f"trainer {installed} (pytest-gpusched)\n"


def test_the_installed_version_is_pyprojects():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    installed = metadata.version("pytest-gpusched")
    assert installed == declared, (
        f"pyproject.toml says {declared} but the installed metadata says {installed}: "
        "run ./setup.sh (pip install -e .) again to refresh it"
    )
