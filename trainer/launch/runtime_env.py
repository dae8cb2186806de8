"""The trainer's production Ray runtime env, and its worker setup hook.

``get_runtime_env()`` is what the driver passes to ``ray.init(runtime_env=...)``
and what this repository's e2e tests start Ray with (``rl_e2e_runtime_env`` in
``pyproject.toml`` names it). The layering itself (defaults < forwarded host
variables < the ``ray job submit`` runtime env) lives in ``rl_e2e.runtime_env``;
here are only the trainer's choices:

- the usual RL defaults (``RL_DEFAULT_ENV_VARS``) and forwarded prefixes, plus
  ``TRAINER_``;
- ``TRAINER_EXCLUDE``: names and globs never forwarded;
- ``WARM_PRELOAD``: workers are forked from a per-node process that imported
  the third-party modules they use once (``RL_E2E_WARM_WORKERS=0``: off);
- ``worker_setup`` as Ray's ``worker_process_setup_hook`` (a dotted path: Ray
  imports it by name in each worker). It configures the trainer's logging and
  then runs the user's ``TRAINER_EXTRA_WORKER_SETUP_HOOK="/abs/file.py:function"``.
  It never raises: Ray kills a worker whose setup hook raises.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from rl_e2e.knobs import env_str
from rl_e2e.runtime_env import (
    RL_DEFAULT_ENV_VARS,
    RL_FORWARD_PREFIXES,
    RuntimeEnvLayers,
    run_extra_hook,
)

__all__ = [
    "DEFAULT_ENV_VARS",
    "EXCLUDE_VAR",
    "EXTRA_HOOK_VAR",
    "FORWARD_PREFIXES",
    "LAYERS",
    "WARM_PRELOAD",
    "WORKER_SETUP_HOOK",
    "get_runtime_env",
    "worker_setup",
]

logger = logging.getLogger(__name__)

DEFAULT_ENV_VARS: dict[str, str] = dict(RL_DEFAULT_ENV_VARS)
FORWARD_PREFIXES: tuple[str, ...] = (*RL_FORWARD_PREFIXES, "TRAINER_")
EXCLUDE_VAR = "TRAINER_EXCLUDE"
EXTRA_HOOK_VAR = "TRAINER_EXTRA_WORKER_SETUP_HOOK"
LOG_LEVEL_VAR = "TRAINER_LOG_LEVEL"
WORKER_SETUP_HOOK = "trainer.launch.runtime_env.worker_setup"

# What every trainer worker imports before its first line of work; a node's warm
# process imports them once and forks the workers (rl_e2e.warm_workers). Named
# down to the modules that do the work: ``transformers`` alone is a lazy module
# whose models, tokenizers and generation code each worker would import again.
WARM_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "tensordict",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.generation.utils",
    "tokenizers",
    "omegaconf",
)

LAYERS = RuntimeEnvLayers(
    defaults=DEFAULT_ENV_VARS,
    forward_prefixes=FORWARD_PREFIXES,
    exclude_var=EXCLUDE_VAR,
    setup_hook=WORKER_SETUP_HOOK,
    warm_preload=WARM_PRELOAD,
)


def get_runtime_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the runtime env for ``ray.init(runtime_env=...)``, read from ``environ`` now.

    ``environ`` defaults to ``os.environ``. See ``RuntimeEnvLayers.compose``.
    """
    return LAYERS.compose(environ)


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
        run_extra_hook(spec, EXTRA_HOOK_VAR)
