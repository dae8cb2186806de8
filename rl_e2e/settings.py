"""The plugin's ini options: one table for pytest's ``addini``, the docs and the checks.

Each option is read from ``[tool.pytest.ini_options]`` (or ``pytest.ini``,
``tox.ini``, ``setup.cfg``). :func:`read_settings` turns the raw values into a
:class:`Settings`, raising :class:`SettingsError` that names the option and what
is wrong with it; pure, so it is tested without a pytest session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIONS", "IniOption", "Settings", "SettingsError", "is_module_name", "read_settings"]


class SettingsError(ValueError):
    """A malformed ini value; the message names the option."""


@dataclass(frozen=True)
class IniOption:
    """One ini option: its name, pytest's ``addini`` type, its default and its help."""

    name: str
    type: str  # "string", "linelist" or "args", as pytest's addini takes it
    default: Any
    help: str


OPTIONS: tuple[IniOption, ...] = (
    IniOption(
        "rl_e2e_runtime_env",
        "string",
        "",
        "package.module:function returning the runtime_env dict your driver passes to "
        "ray.init (your production builder). Excludes the rl_e2e_env_* options.",
    ),
    IniOption(
        "rl_e2e_env_defaults",
        "linelist",
        [],
        "NAME=VALUE lines: the default env_vars of the layered runtime env "
        "(default: rl_e2e.runtime_env.RL_DEFAULT_ENV_VARS).",
    ),
    IniOption(
        "rl_e2e_env_forward",
        "args",
        [],
        "Prefixes of host variables forwarded to the workers "
        "(default: rl_e2e.runtime_env.RL_FORWARD_PREFIXES).",
    ),
    IniOption(
        "rl_e2e_env_exclude",
        "args",
        [],
        "Names or globs never forwarded (HF_TOKEN, WANDB_*).",
    ),
    IniOption(
        "rl_e2e_env_exclude_var",
        "string",
        "",
        "A host variable whose comma-separated value excludes more names at run time.",
    ),
    IniOption(
        "rl_e2e_env_setup_hook",
        "string",
        "",
        "Dotted path of the worker_process_setup_hook every Ray worker runs.",
    ),
    IniOption(
        "rl_e2e_env_warm_preload",
        "args",
        [],
        "Modules (third-party: torch transformers) each node's warm process imports once; "
        "Ray workers are forked from it instead of importing them again.",
    ),
    IniOption(
        "rl_e2e_ray_scope",
        "string",
        "module",
        "Scope of the e2e_ray cluster fixtures: module (default) or session.",
    ),
    IniOption(
        "rl_e2e_ray_num_cpus",
        "string",
        "2",
        "CPUs of each e2e_ray cluster (an int >= 1).",
    ),
    IniOption(
        "rl_e2e_rank_timeout",
        "string",
        "600",
        "Seconds an e2e_distributed run may take, from the moment every rank has joined "
        "the group, before every rank's stack is dumped and the ranks are killed.",
    ),
    IniOption(
        "rl_e2e_rank_preload",
        "args",
        [],
        "Modules (third-party: tensordict transformers) the e2e_distributed ranks' fork "
        "server imports once, after torch; each rank then finds them imported.",
    ),
    IniOption(
        "rl_e2e_log_bytes",
        "string",
        "16000",
        "At most this many bytes of each rank's output and of the Ray worker logs go into "
        "a failing test's report.",
    ),
)


@dataclass(frozen=True)
class Settings:
    """The plugin's resolved settings (see :data:`OPTIONS` for each one's meaning)."""

    runtime_env: str = ""
    env_defaults: dict[str, str] | None = None
    env_forward: tuple[str, ...] | None = None
    env_exclude: tuple[str, ...] = ()
    env_exclude_var: str = ""
    env_setup_hook: str = ""
    env_warm_preload: tuple[str, ...] = ()
    ray_scope: str = "module"
    ray_num_cpus: int = 2
    rank_timeout: float = 600.0
    rank_preload: tuple[str, ...] = ()
    log_bytes: int = 16000

    @property
    def layered(self) -> bool:
        """True when the runtime env comes from the layered composer, not a builder."""
        return not self.runtime_env


def is_module_name(name: object) -> bool:
    """Whether ``name`` is a dotted module name (``package.module``), as the preload lists take."""
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(str(raw).strip(), 10)
    except ValueError:
        raise SettingsError(f"{name} = {raw!r}: not an integer") from None
    if value < 1:
        raise SettingsError(f"{name} = {raw!r}: must be >= 1")
    return value


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise SettingsError(f"{name} = {raw!r}: not a number of seconds") from None
    if not value > 0 or value != value:
        raise SettingsError(f"{name} = {raw!r}: must be a number of seconds > 0")
    return value


def _defaults(lines: Sequence[str]) -> dict[str, str] | None:
    if not lines:
        return None
    found: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise SettingsError(
                f"rl_e2e_env_defaults: {line!r} is not a NAME=VALUE line "
                "(one variable a line, NAME a valid variable name)"
            )
        found[name] = value.strip()
    return found


def _entry_point(name: str, raw: str) -> str:
    text = raw.strip()
    module, sep, func = text.partition(":")
    if text and (
        not sep
        or not func.isidentifier()
        or not all(part.isidentifier() for part in module.split("."))
    ):
        raise SettingsError(f"{name} = {raw!r}: must look like package.module:function")
    return text


def read_settings(get: Callable[[str], Any]) -> Settings:
    """Resolve every option through ``get(name)`` (pytest's ``config.getini``).

    Raises:
        SettingsError: a malformed value, or a builder and composer options at once.
    """
    settings = Settings(
        runtime_env=_entry_point("rl_e2e_runtime_env", str(get("rl_e2e_runtime_env") or "")),
        env_defaults=_defaults(list(get("rl_e2e_env_defaults") or [])),
        env_forward=tuple(get("rl_e2e_env_forward") or ()) or None,
        env_exclude=tuple(get("rl_e2e_env_exclude") or ()),
        env_exclude_var=str(get("rl_e2e_env_exclude_var") or "").strip(),
        env_setup_hook=str(get("rl_e2e_env_setup_hook") or "").strip(),
        env_warm_preload=tuple(get("rl_e2e_env_warm_preload") or ()),
        ray_scope=str(get("rl_e2e_ray_scope") or "module").strip(),
        ray_num_cpus=_positive_int("rl_e2e_ray_num_cpus", get("rl_e2e_ray_num_cpus") or "2"),
        rank_timeout=_positive_float("rl_e2e_rank_timeout", get("rl_e2e_rank_timeout") or "600"),
        rank_preload=tuple(get("rl_e2e_rank_preload") or ()),
        log_bytes=_positive_int("rl_e2e_log_bytes", get("rl_e2e_log_bytes") or "16000"),
    )
    if settings.ray_scope not in ("module", "session"):
        raise SettingsError(
            f"rl_e2e_ray_scope = {settings.ray_scope!r}: must be 'module' or 'session'"
        )
    if settings.env_exclude_var and not settings.env_exclude_var.isidentifier():
        raise SettingsError(
            f"rl_e2e_env_exclude_var = {settings.env_exclude_var!r}: not a variable name"
        )
    hook = settings.env_setup_hook
    if hook and ("." not in hook or not all(part.isidentifier() for part in hook.split("."))):
        raise SettingsError(
            f"rl_e2e_env_setup_hook = {hook!r}: must be a dotted path package.module.function"
        )
    for name, modules in (
        ("rl_e2e_env_warm_preload", settings.env_warm_preload),
        ("rl_e2e_rank_preload", settings.rank_preload),
    ):
        for module in modules:
            if not is_module_name(module):
                raise SettingsError(f"{name}: {module!r} is not a module name (package.module)")
    composer = [
        name
        for name, value in (
            ("rl_e2e_env_defaults", settings.env_defaults),
            ("rl_e2e_env_forward", settings.env_forward),
            ("rl_e2e_env_exclude", settings.env_exclude),
            ("rl_e2e_env_exclude_var", settings.env_exclude_var),
            ("rl_e2e_env_setup_hook", settings.env_setup_hook),
            ("rl_e2e_env_warm_preload", settings.env_warm_preload),
        )
        if value
    ]
    if settings.runtime_env and composer:
        raise SettingsError(
            f"rl_e2e_runtime_env names a builder, so {', '.join(composer)} would be ignored: "
            "set one or the other"
        )
    return settings
