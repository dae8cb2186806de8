"""Where a test session's runtime env comes from: the repository's builder, or the layers.

A repository either names its own production builder (``rl_e2e_runtime_env =
package.module:function``, a function of no arguments returning the dict its
driver passes to ``ray.init``) or configures :class:`~rl_e2e.runtime_env.RuntimeEnvLayers`
from ini. :class:`RuntimeEnvSource` hides which: ``build(host_env)`` gives the
runtime env as if ``host_env`` were set on the driver's host, checked as Ray
would take it. Imports neither Ray nor torch (a builder may).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rl_e2e.runtime_env import (
    RL_DEFAULT_ENV_VARS,
    RL_FORWARD_PREFIXES,
    RuntimeEnvLayers,
    check_runtime_env,
)
from rl_e2e.settings import Settings, SettingsError

__all__ = ["RuntimeEnvSource", "load_builder", "patched_environ", "source_from_settings"]


def load_builder(spec: str, option: str = "rl_e2e_runtime_env") -> Callable[[], Any]:
    """Import ``package.module:function`` and return the function.

    Raises:
        SettingsError: the module does not import (with the import's own error),
            or it has no such callable; the message names ``option``.
    """
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to see
        raise SettingsError(
            f"{option} = {spec!r}: cannot import {module_name!r}: {type(err).__name__}: {err}"
        ) from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise SettingsError(f"{option} = {spec!r}: {module_name} has no function {func_name!r}")
    return func


@contextmanager
def patched_environ(extra: Mapping[str, str | None]) -> Iterator[None]:
    """Set ``extra`` in ``os.environ`` for the duration (None: unset); restore exactly what was there."""
    saved = {name: os.environ.get(name) for name in extra}
    for name, value in extra.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class RuntimeEnvSource:
    """A builder of runtime envs, and a name for it in the header and in errors."""

    name: str
    builder: Callable[[], Any]

    def build(self, host_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The runtime env composed now, with ``host_env`` set on the host meanwhile.

        Raises:
            TypeError, ValueError: the builder gave something Ray would refuse
                (the message names the source).
        """
        with patched_environ(dict(host_env or {})):
            built = self.builder()
        return check_runtime_env(built, self.name)

    @classmethod
    def fixed(cls, runtime_env: Mapping[str, Any], name: str) -> RuntimeEnvSource:
        """A source that always gives ``runtime_env``; a host env is added to its ``env_vars``."""
        checked = check_runtime_env(dict(runtime_env), name)
        return _FixedSource(name, lambda: checked)


@dataclass(frozen=True)
class _FixedSource(RuntimeEnvSource):
    """:meth:`RuntimeEnvSource.fixed`: no host to read, so host variables go in directly."""

    def build(self, host_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        built = dict(self.builder())
        built["env_vars"] = {**(built.get("env_vars") or {}), **dict(host_env or {})}
        return check_runtime_env(built, self.name)


def source_from_settings(settings: Settings) -> RuntimeEnvSource:
    """The builder ``rl_e2e_runtime_env`` names, or the layered composer the ini configures."""
    if settings.runtime_env:
        return RuntimeEnvSource(settings.runtime_env, load_builder(settings.runtime_env))
    layers = RuntimeEnvLayers(
        defaults=dict(
            RL_DEFAULT_ENV_VARS if settings.env_defaults is None else settings.env_defaults
        ),
        forward_prefixes=settings.env_forward or RL_FORWARD_PREFIXES,
        exclude=settings.env_exclude,
        exclude_var=settings.env_exclude_var or None,
        setup_hook=settings.env_setup_hook or None,
        warm_preload=settings.env_warm_preload,
    )
    configured = settings.env_defaults is not None or settings.env_forward or settings.env_exclude
    name = "the layered runtime env of the rl_e2e_env_* options"
    if not configured:
        name = "the layered runtime env with rl_e2e's RL defaults"
    return RuntimeEnvSource(name, layers.compose)
