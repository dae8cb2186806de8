"""Ray workers started warm: forked from a process of their node that has the heavy modules imported.

A Ray worker is a fresh interpreter: every actor of a trainer imports torch,
tensordict and transformers again, several CPU seconds each, and an RL test
suite starts hundreds of them. With warm start on, the runtime env names
:mod:`rl_e2e.worker_shim` as the workers' ``py_executable``; the first worker
of a node starts a warm process (:mod:`rl_e2e.worker_zygote`) that imports the
modules named here once, and every worker after it is forked from it with its
own environment, directory, arguments and log files.

Only third-party modules should be named: what the warm process imports is
imported unmeasured by coverage and before the worker's environment is known
(the warm process is shared only by workers with the same interpreter and
environment, so import-time settings such as ``HF_HUB_OFFLINE`` still agree).

Off when ``RL_E2E_WARM_WORKERS=0``, and where the job's runtime env picks the
workers' interpreter itself (``py_executable``, ``pip``, ``uv``, ``conda``,
``container``, ``image_uri``). Every node needs this package at the driver's
path (one image or checkout for the cluster).
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_e2e.worker_shim import PRELOAD_VARIABLE

__all__ = ["OWN_INTERPRETER_KEYS", "SWITCH_VARIABLE", "py_executable", "warm_runtime_env"]

logger = logging.getLogger(__name__)

SWITCH_VARIABLE = "RL_E2E_WARM_WORKERS"
OWN_INTERPRETER_KEYS = ("py_executable", "pip", "uv", "conda", "container", "image_uri")
SHIM = Path(__file__).with_name("worker_shim.py")


def py_executable(executable: str | None = None) -> str:
    """The ``py_executable`` that starts workers through the shim (``-S``: no site, stdlib only)."""
    return f"{shlex.quote(executable or sys.executable)} -S {shlex.quote(str(SHIM))}"


def warm_runtime_env(
    runtime_env: Mapping[str, Any],
    preload: Sequence[str],
    job: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``runtime_env`` with warm start for ``preload``, or unchanged where the job picks the interpreter.

    ``job`` is the ``ray job submit`` runtime env (Ray merges it over ours).
    """
    out = dict(runtime_env)
    if not preload:
        return out
    chosen = [key for key in OWN_INTERPRETER_KEYS if key in out or key in (job or {})]
    if chosen:
        logger.info("warm worker start off: the runtime env sets %s", ", ".join(chosen))
        return out
    out["py_executable"] = py_executable()
    out["env_vars"] = {**out.get("env_vars", {}), PRELOAD_VARIABLE: ",".join(preload)}
    return out
