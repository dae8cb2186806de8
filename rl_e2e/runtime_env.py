"""A Ray runtime env composed in three layers, and the pieces of a worker setup hook.

A repository's production runtime env (what its driver passes to
``ray.init(runtime_env=...)``) is composed from three layers, later wins:

1. defaults every worker should have (``RL_DEFAULT_ENV_VARS`` for the usual RL
   stack, each explained below, or a repository's own);
2. host variables forwarded by prefix, minus the names and glob patterns the
   repository excludes (statically, or at run time through a variable such as
   ``TRAINER_EXCLUDE``);
3. the runtime env of ``ray job submit --runtime-env-json``, which Ray hands the
   job's driver in ``RAY_JOB_CONFIG_JSON_ENV_VAR``. Ray refuses to merge a job
   runtime env with a ``ray.init`` one that sets the same keys (unless
   ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``), so instead of overriding we *leave out*
   every key the job sets: Ray's merge then keeps the job's value.

:class:`RuntimeEnvLayers` holds one repository's choices; pure functions do the
composition, so it is unit-tested without effects. The trainer
(``trainer/launch/runtime_env.py``) and the e2e plugin (``rl_e2e.plugin``) use
this module; it imports neither Ray nor torch.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_e2e.knobs import env_bool, redact
from rl_e2e.warm_workers import SWITCH_VARIABLE, warm_runtime_env

__all__ = [
    "JOB_CONFIG_VAR",
    "RAY_RUNTIME_ENV_KEYS",
    "RL_DEFAULT_ENV_VARS",
    "RL_FORWARD_PREFIXES",
    "RuntimeEnvLayers",
    "check_runtime_env",
    "compose_runtime_env",
    "describe_env_vars",
    "describe_runtime_env",
    "forwarded_env_vars",
    "load_hook",
    "parse_exclude",
    "parse_hook_spec",
    "parse_job_runtime_env",
    "run_extra_hook",
]

logger = logging.getLogger(__name__)

RL_DEFAULT_ENV_VARS: dict[str, str] = {
    # Ray workers are fresh processes, or forks of a warm process that only imported
    # modules (rl_e2e.warm_workers), never of one that used a tokenizer, so the Rust
    # thread pool is safe. Saying so explicitly keeps
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
# forwarded too: the NCCL loopback guard (rl_e2e.netguard) may set
# GLOO_SOCKET_IFNAME on the driver, and a cluster not started by the driver (a
# `ray job submit`) would not otherwise see it.
RL_FORWARD_PREFIXES: tuple[str, ...] = (
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
    "GLOO_",
)

# The variable Ray's job supervisor sets for a submitted job's driver
# (ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR, Ray 2.60).
JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"

# The top-level keys Ray 2.60 knows (ray.runtime_env.RuntimeEnv.known_fields);
# tests/rl_e2e/test_runtime_env.py keeps this list equal to Ray's. Ray would take
# any other key as the name of a runtime-env plugin and fail only when a worker
# starts, so a typo (``env_var``) is refused here, where it is made.
RAY_RUNTIME_ENV_KEYS: frozenset[str] = frozenset(
    {
        "py_modules",
        "py_executable",
        "java_jars",
        "working_dir",
        "conda",
        "pip",
        "uv",
        "container",
        "excludes",
        "env_vars",
        "_ray_release",
        "_ray_commit",
        "_inject_current_ray",
        "config",
        "worker_process_setup_hook",
        "_nsight",
        "_rocprof_sys",
        "image_uri",
    }
)


def parse_exclude(spec: str) -> tuple[str, ...]:
    """Split an exclude list (``TRAINER_EXCLUDE``'s value) into names and glob patterns.

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
    prefixes: tuple[str, ...] = RL_FORWARD_PREFIXES,
    never: tuple[str, ...] = (),
) -> dict[str, str]:
    """Return the host variables that go to the workers.

    A variable is forwarded when its name starts with one of ``prefixes`` and
    matches none of ``exclude`` (exact names or ``fnmatch`` globs, ``VLLM*``
    drops every name starting with ``VLLM``). Names in ``never`` (the exclude
    variable itself: an instruction to the driver, not a setting for workers)
    are never forwarded.
    """
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(prefixes) and name not in never and not _is_excluded(name, exclude)
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
    setup_hook: str | None = None,
) -> dict[str, Any]:
    """Compose the ``ray.init`` runtime env from the three layers, later wins.

    ``defaults`` < ``forwarded``; every ``env_vars`` key of ``job_runtime_env`` is
    removed from ours so that Ray's job/driver merge keeps the job's value.
    ``working_dir: None`` and ``setup_hook`` (as ``worker_process_setup_hook``)
    are only set when the job does not set them (Ray refuses the merge otherwise).
    """
    job = dict(job_runtime_env or {})
    env_vars = {**defaults, **forwarded}
    for name in job.get("env_vars") or {}:
        env_vars.pop(name, None)
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if "working_dir" not in job:
        runtime_env["working_dir"] = None
    if setup_hook and "worker_process_setup_hook" not in job:
        runtime_env["worker_process_setup_hook"] = setup_hook
    return runtime_env


@dataclass(frozen=True)
class RuntimeEnvLayers:
    """One repository's runtime env: its defaults, what it forwards, what it excludes.

    ``exclude`` is fixed (names or globs); ``exclude_var`` names a host variable
    whose comma-separated value excludes more at run time (the trainer's
    ``TRAINER_EXCLUDE``). ``setup_hook`` is the dotted path Ray imports in every
    worker as its ``worker_process_setup_hook``. ``warm_preload``: the modules a
    node's warm process imports for its workers (:mod:`rl_e2e.warm_workers`);
    none, or ``RL_E2E_WARM_WORKERS=0``, starts every worker cold.
    """

    defaults: Mapping[str, str] = field(default_factory=lambda: dict(RL_DEFAULT_ENV_VARS))
    forward_prefixes: tuple[str, ...] = RL_FORWARD_PREFIXES
    exclude: tuple[str, ...] = ()
    exclude_var: str | None = None
    setup_hook: str | None = None
    warm_preload: tuple[str, ...] = ()

    def compose(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Return the runtime env for ``ray.init`` from ``environ`` (default ``os.environ``, read now).

        A malformed job config is a warning and the first two layers are used.
        Logs what it composed, never the value of a secret-looking variable.
        """
        source: Mapping[str, str] = os.environ if environ is None else environ
        exclude = self.exclude
        never: tuple[str, ...] = ()
        if self.exclude_var:
            exclude += parse_exclude(source.get(self.exclude_var, ""))
            never = (self.exclude_var,)
        forwarded = forwarded_env_vars(source, exclude, self.forward_prefixes, never)
        try:
            job = parse_job_runtime_env(source.get(JOB_CONFIG_VAR))
        except ValueError as err:
            logger.warning("ignoring the job's runtime env: %s", err)
            job = None
        runtime_env = compose_runtime_env(self.defaults, forwarded, job, self.setup_hook)
        if env_bool(SWITCH_VARIABLE, True, environ=source):
            runtime_env = warm_runtime_env(runtime_env, self.warm_preload, job)
        if job is not None:
            logger.info(
                "ray job runtime env sets %s; left to the job",
                sorted({*(job.get("env_vars") or {}), *(k for k in job if k != "env_vars")}),
            )
            if self.setup_hook and "worker_process_setup_hook" in job:
                logger.warning(
                    "the job sets its own worker_process_setup_hook; %s will not run",
                    self.setup_hook,
                )
        logger.info("runtime env vars: %s", describe_env_vars(runtime_env["env_vars"]))
        return runtime_env


def check_runtime_env(runtime_env: object, source: str) -> dict[str, Any]:
    """Return ``runtime_env`` if it is a dict Ray would take, else raise naming ``source``.

    Checked without Ray: a dict, string keys among :data:`RAY_RUNTIME_ENV_KEYS`,
    ``env_vars`` a mapping of strings to strings.

    Raises:
        TypeError: not a dict, or ``env_vars`` holds something else than strings.
        ValueError: a key Ray does not know.
    """
    if not isinstance(runtime_env, dict):
        raise TypeError(f"{source} must give a dict, got {type(runtime_env).__name__}")
    unknown = sorted(str(key) for key in runtime_env if key not in RAY_RUNTIME_ENV_KEYS)
    if unknown:
        raise ValueError(
            f"{source}: Ray knows no runtime env key {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(sorted(k for k in RAY_RUNTIME_ENV_KEYS if not k.startswith('_')))})"
        )
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, Mapping):
        raise TypeError(
            f"{source}: 'env_vars' must be a dict of strings, got {type(env_vars).__name__}"
        )
    bad = sorted(
        str(name)
        for name, value in env_vars.items()
        if not isinstance(name, str) or not isinstance(value, str)
    )
    if bad:
        raise TypeError(f"{source}: 'env_vars' values must be strings; not so for {', '.join(bad)}")
    return runtime_env


def describe_env_vars(env_vars: Mapping[str, str]) -> str:
    """One log-safe line ``A=1 B=<redacted>``: values of secret-looking names hidden."""
    return " ".join(f"{name}={redact(name, value)}" for name, value in sorted(env_vars.items()))


def describe_runtime_env(runtime_env: Mapping[str, Any]) -> str:
    """One log-safe line for a whole runtime env: its variables, then its other keys."""
    parts = [f"env_vars: {describe_env_vars(runtime_env.get('env_vars') or {}) or '(none)'}"]
    parts += [f"{key}={value!r}" for key, value in sorted(runtime_env.items()) if key != "env_vars"]
    return "; ".join(parts)


def parse_hook_spec(spec: str, variable: str) -> tuple[Path, str]:
    """Split ``"/abs/file.py:function"`` (the value of ``variable``) into file and function.

    Raises:
        ValueError: naming ``variable`` when the spec has no ``:function`` part,
            the path is not absolute, or the file is missing.
    """
    path_text, sep, func_name = spec.strip().rpartition(":")
    if not sep or not path_text or not func_name.isidentifier():
        raise ValueError(f"{variable}={spec!r} must look like /abs/path/file.py:function")
    path = Path(path_text)
    if not path.is_absolute():
        raise ValueError(f"{variable}={spec!r}: {path_text!r} is not an absolute path")
    if not path.is_file():
        raise ValueError(f"{variable}={spec!r}: no file at {path_text!r}")
    return path, func_name


def load_hook(spec: str, variable: str) -> Callable[[], object]:
    """Import the file named by ``spec`` (even when not on ``sys.path``) and return the function.

    Raises:
        ValueError: the spec is malformed, the file is not importable Python, or
            the function is missing or not callable (the message names ``variable``).
        Exception: whatever executing the file raises.
    """
    path, func_name = parse_hook_spec(spec, variable)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"_rl_e2e_extra_hook_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{variable}={spec!r}: {path} is not a Python file")
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
        raise ValueError(f"{variable}={spec!r}: {path} has no function {func_name!r}")
    return func


def run_extra_hook(spec: str, variable: str) -> bool:
    """Load and call the hook ``spec`` names; log any failure with its traceback, never raise.

    Returns True when the hook ran to completion. ``SystemExit`` from the hook is
    caught too: a hook must not be able to end the worker (Ray kills a worker
    whose setup hook raises).
    """
    try:
        load_hook(spec, variable)()
    except (Exception, SystemExit):
        logger.exception("%s=%r failed; the worker continues without it", variable, spec)
        return False
    return True
