"""The trainer's production Ray runtime env, and the worker setup hook.

``get_runtime_env()`` is what the driver passes to ``ray.init(runtime_env=...)``
(and what the e2e fixtures pass too, so tests run with the production
environment). It is composed in three layers, later wins:

1. ``DEFAULT_ENV_VARS`` -- settings every worker should have (each explained below);
2. host variables forwarded by prefix (``FORWARD_PREFIXES``), minus the names and
   glob patterns listed in ``TRAINER_EXCLUDE``;
3. the runtime env of ``ray job submit --runtime-env-json``, which Ray hands the
   job's driver in ``RAY_JOB_CONFIG_JSON_ENV_VAR``. Ray refuses to merge a job
   runtime env with a ``ray.init`` one that sets the same keys (unless
   ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``), so instead of overriding we *leave out*
   every key the job sets: Ray's merge then keeps the job's value.

Pure composition (``parse_exclude``, ``forwarded_env_vars``,
``parse_job_runtime_env``, ``compose_runtime_env``) is separate from reading
``os.environ`` and logging (``get_runtime_env``) so it is unit-tested without
effects. Called by the driver (``python -m trainer``) and the e2e fixtures.

``worker_setup`` runs in every Ray worker process of the job (Ray's
``worker_process_setup_hook``, given as a dotted path because Ray imports it by
name in the worker): it configures the trainer's logging and then runs the
user's ``TRAINER_EXTRA_WORKER_SETUP_HOOK="/abs/file.py:function"``. It never
raises: Ray kills a worker whose setup hook raises.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.env import env_str, redact

__all__ = [
    "DEFAULT_ENV_VARS",
    "EXCLUDE_VAR",
    "EXTRA_HOOK_VAR",
    "FORWARD_PREFIXES",
    "JOB_CONFIG_VAR",
    "WORKER_SETUP_HOOK",
    "compose_runtime_env",
    "describe_env_vars",
    "forwarded_env_vars",
    "get_runtime_env",
    "load_hook",
    "parse_exclude",
    "parse_hook_spec",
    "parse_job_runtime_env",
    "run_extra_hook",
    "worker_setup",
]

logger = logging.getLogger(__name__)

DEFAULT_ENV_VARS: dict[str, str] = {
    # Ray workers are fresh processes, not forks of a process that already used a
    # tokenizer, so the Rust thread pool is safe. Saying so explicitly keeps
    # batch tokenization parallel and silences the fork warning HF prints.
    "TOKENIZERS_PARALLELISM": "true",
    # NCCL's warnings (transport fallbacks, timeouts) without the INFO flood of
    # one line per ring/channel per rank. `ray job submit` may raise it to INFO.
    "NCCL_DEBUG": "WARN",
    # vLLM logs every request and engine step at INFO; one engine per rollout
    # worker makes the driver's log unreadable.
    "VLLM_LOGGING_LEVEL": "WARN",
    # One hardware work queue per device: kernels start in issue order, which
    # overlapping communication with compute (tensor/sequence parallel) relies on.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # NCCL's cuMem allocator keeps memory that a colocated rollout engine wants
    # back when it wakes up, and its buffers cannot be shared by CUDA IPC handles
    # (used to hand weights to the engine); the classic allocator avoids both.
    "NCCL_CUMEM_ENABLE": "0",
}

# Host variables whose names start with one of these reach the workers. GLOO_ is
# forwarded too: the NCCL loopback guard (trainer.netguard) may set
# GLOO_SOCKET_IFNAME on the driver, and a cluster not started by the driver (a
# `ray job submit`) would not otherwise see it.
FORWARD_PREFIXES: tuple[str, ...] = (
    "VLLM_",
    "SGL_",
    "SGLANG_",
    "HF_",
    "TOKENIZERS_",
    "DATASETS_",
    "TORCH_",
    "PYTORCH_",
    "DEEPSPEED_",
    "MEGATRON_",
    "NCCL_",
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
    "NV_",
    "NVIDIA_",
    "TRAINER_",
    "GLOO_",
)

EXCLUDE_VAR = "TRAINER_EXCLUDE"
EXTRA_HOOK_VAR = "TRAINER_EXTRA_WORKER_SETUP_HOOK"
LOG_LEVEL_VAR = "TRAINER_LOG_LEVEL"
# The variable Ray's job supervisor sets for a submitted job's driver
# (ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR, Ray 2.60).
JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Dotted path: Ray imports the hook by name inside each worker.
WORKER_SETUP_HOOK = "trainer.runtime_env.worker_setup"


def parse_exclude(spec: str) -> tuple[str, ...]:
    """Split a ``TRAINER_EXCLUDE`` value into names and glob patterns.

    ``" VLLM*, HF_HOME ,"`` -> ``("VLLM*", "HF_HOME")``: comma-separated,
    whitespace around entries ignored, empty entries dropped.
    """
    return tuple(entry.strip() for entry in spec.split(",") if entry.strip())


def _is_excluded(name: str, patterns: tuple[str, ...]) -> bool:
    # fnmatchcase: environment names are case-sensitive on the platforms Ray runs on;
    # a pattern without wildcards only matches the exact name.
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def forwarded_env_vars(
    environ: Mapping[str, str],
    exclude: tuple[str, ...] = (),
    prefixes: tuple[str, ...] = FORWARD_PREFIXES,
) -> dict[str, str]:
    """Return the host variables that go to the workers.

    A variable is forwarded when its name starts with one of ``prefixes`` and
    matches none of ``exclude`` (exact names or ``fnmatch`` globs, ``VLLM*``
    drops every name starting with ``VLLM``). ``TRAINER_EXCLUDE`` itself is never
    forwarded: it is an instruction to the driver, not a setting for workers.
    """
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(prefixes) and name != EXCLUDE_VAR and not _is_excluded(name, exclude)
    }


def parse_job_runtime_env(raw: str | None) -> dict[str, Any] | None:
    """Return the runtime env of a submitted job from Ray's job-config JSON.

    ``raw`` is the value of ``RAY_JOB_CONFIG_JSON_ENV_VAR`` (``None`` or empty
    when the driver was not started by ``ray job submit``, giving ``None``).

    Raises:
        ValueError: the JSON does not parse, or it or its ``runtime_env`` /
            ``env_vars`` is not an object; the message names the variable.
    """
    if raw is None or not raw.strip():
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{JOB_CONFIG_VAR} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{JOB_CONFIG_VAR} must be a JSON object, got {type(config).__name__}")
    runtime_env = config.get("runtime_env") or {}
    if not isinstance(runtime_env, dict):
        raise ValueError(
            f"{JOB_CONFIG_VAR}: 'runtime_env' must be an object, got {type(runtime_env).__name__}"
        )
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        raise ValueError(
            f"{JOB_CONFIG_VAR}: 'runtime_env.env_vars' must be an object, "
            f"got {type(env_vars).__name__}"
        )
    return runtime_env


def compose_runtime_env(
    defaults: Mapping[str, str],
    forwarded: Mapping[str, str],
    job_runtime_env: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Compose the ``ray.init`` runtime env from the three layers, later wins.

    ``defaults`` < ``forwarded``; every ``env_vars`` key of ``job_runtime_env`` is
    removed from ours so that Ray's job/driver merge keeps the job's value.
    ``working_dir: None`` and our ``worker_process_setup_hook`` are only set
    when the job does not set them (Ray refuses the merge otherwise).
    """
    job = dict(job_runtime_env or {})
    env_vars = {**defaults, **forwarded}
    for name in job.get("env_vars") or {}:
        env_vars.pop(name, None)
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if "working_dir" not in job:
        runtime_env["working_dir"] = None
    if "worker_process_setup_hook" not in job:
        runtime_env["worker_process_setup_hook"] = WORKER_SETUP_HOOK
    return runtime_env


def describe_env_vars(env_vars: Mapping[str, str]) -> str:
    """One log-safe line ``A=1 B=<redacted>``: values of secret-looking names hidden."""
    return " ".join(f"{name}={redact(name, value)}" for name, value in sorted(env_vars.items()))


def get_runtime_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the runtime env for ``ray.init(runtime_env=...)``.

    Reads ``environ`` (default ``os.environ``, read now): ``TRAINER_EXCLUDE``,
    the forwarded prefixes and Ray's job config. A malformed job config is a
    warning and the first two layers are used. Logs what it composed, never the
    value of a secret-looking variable.
    """
    source: Mapping[str, str] = os.environ if environ is None else environ
    exclude = parse_exclude(source.get(EXCLUDE_VAR, ""))
    forwarded = forwarded_env_vars(source, exclude)
    try:
        job = parse_job_runtime_env(source.get(JOB_CONFIG_VAR))
    except ValueError as err:
        logger.warning("ignoring the job's runtime env: %s", err)
        job = None
    runtime_env = compose_runtime_env(DEFAULT_ENV_VARS, forwarded, job)
    if job is not None:
        logger.info(
            "ray job runtime env sets %s; left to the job",
            sorted({*(job.get("env_vars") or {}), *(k for k in job if k != "env_vars")}),
        )
        if "worker_process_setup_hook" in job:
            logger.warning(
                "the job sets its own worker_process_setup_hook; %s and %s will not run",
                WORKER_SETUP_HOOK,
                EXTRA_HOOK_VAR,
            )
    logger.info("runtime env vars: %s", describe_env_vars(runtime_env["env_vars"]))
    return runtime_env


def parse_hook_spec(spec: str) -> tuple[Path, str]:
    """Split ``"/abs/file.py:function"`` into the file and the function name.

    Raises:
        ValueError: naming ``TRAINER_EXTRA_WORKER_SETUP_HOOK`` when the spec has no
            ``:function`` part, the path is not absolute, or the file is missing.
    """
    path_text, sep, func_name = spec.strip().rpartition(":")
    if not sep or not path_text or not func_name.isidentifier():
        raise ValueError(f"{EXTRA_HOOK_VAR}={spec!r} must look like /abs/path/file.py:function")
    path = Path(path_text)
    if not path.is_absolute():
        raise ValueError(f"{EXTRA_HOOK_VAR}={spec!r}: {path_text!r} is not an absolute path")
    if not path.is_file():
        raise ValueError(f"{EXTRA_HOOK_VAR}={spec!r}: no file at {path_text!r}")
    return path, func_name


def load_hook(spec: str) -> Callable[[], object]:
    """Import the file named by ``spec`` (even when not on ``sys.path``) and return the function.

    Raises:
        ValueError: the spec is malformed, the file is not importable Python, or
            the function is missing or not callable (the message names the variable).
        Exception: whatever executing the file raises.
    """
    path, func_name = parse_hook_spec(spec)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"_trainer_extra_hook_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{EXTRA_HOOK_VAR}={spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running so that code in the file which looks itself up
    # (dataclasses, pickle) finds its module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{EXTRA_HOOK_VAR}={spec!r}: {path} has no function {func_name!r}")
    return func


def run_extra_hook(spec: str) -> bool:
    """Load and call the extra hook; log any failure with its traceback, never raise.

    Returns True when the hook ran to completion. ``SystemExit`` from the hook is
    caught too: a hook must not be able to end the worker.
    """
    try:
        load_hook(spec)()
    except (Exception, SystemExit):
        logger.exception("%s=%r failed; the worker continues without it", EXTRA_HOOK_VAR, spec)
        return False
    return True


def _configure_logging() -> None:
    level_name = env_str(LOG_LEVEL_VAR, "INFO").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_VAR}={level_name!r} is not a logging level")
    root = logging.getLogger("trainer")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s pid=%(process)d: %(message)s")
        )
        root.addHandler(handler)


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: per-worker setup, then the extra hook.

    Called by Ray in every worker process of the job before it runs any task.
    Never raises (Ray would kill the worker): failures are logged with traceback.
    """
    try:
        _configure_logging()
    except Exception:
        logger.exception("trainer worker logging setup failed; using Ray's defaults")
    spec = os.environ.get(EXTRA_HOOK_VAR, "").strip()
    if spec:
        run_extra_hook(spec)
