"""Typed readers for environment-variable knobs.

Every ``TRAINER_*`` / ``GPUSCHED_*`` knob (and any a repository using ``rl_e2e``
wants read the same way) is read through one of these helpers so
that the rules are the same everywhere:

- the variable is read from ``os.environ`` when the helper is *called* (never
  cached at import), so tests and the worker setup hook see the current value;
- unset or empty (after stripping whitespace) gives the default;
- a value that does not parse raises ``ValueError`` naming the variable and the
  value, instead of silently falling back to the default.

Every knob must also have a row in the README's ``## Knobs`` table
(``tests/test_knobs_documented.py`` enforces it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = [
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "looks_secret",
    "redact",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

# Names in which one of these words ends a ``_``-separated part (``HF_TOKEN``,
# ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``APIKEY``) hold credentials;
# ``TOKENIZERS_PARALLELISM`` does not.
_SECRET_NAME = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)S?(_|$)", re.IGNORECASE)


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    """Return the stripped value of ``name``, or None when unset or empty."""
    source = os.environ if environ is None else environ
    value = source.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_str(name: str, default: str, *, environ: Mapping[str, str] | None = None) -> str:
    """Read ``name`` as a string; unset or empty gives ``default``."""
    value = _raw(name, environ)
    return default if value is None else value


def env_int(name: str, default: int, *, environ: Mapping[str, str] | None = None) -> int:
    """Read ``name`` as a base-10 integer; unset or empty gives ``default``.

    Raises:
        ValueError: the value is not an integer (the message names the variable).
    """
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        return int(value, 10)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def env_float(name: str, default: float, *, environ: Mapping[str, str] | None = None) -> float:
    """Read ``name`` as a float; unset or empty gives ``default``.

    Raises:
        ValueError: the value is not a finite-or-infinite float literal (the
            message names the variable); ``nan`` is refused because no knob means it.
    """
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
    if parsed != parsed:
        raise ValueError(f"{name}={value!r} is not a number (nan)")
    return parsed


def env_bool(name: str, default: bool, *, environ: Mapping[str, str] | None = None) -> bool:
    """Read ``name`` as a boolean; unset or empty gives ``default``.

    Accepts (case-insensitively) ``1/true/yes/on`` and ``0/false/no/off``.

    Raises:
        ValueError: any other value (the message names the variable and the
            accepted spellings).
    """
    value = _raw(name, environ)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(
        f"{name}={value!r} is not a boolean (use one of {sorted(_TRUE)} or {sorted(_FALSE)})"
    )


def looks_secret(name: str) -> bool:
    """True when a variable's *name* suggests it holds a credential.

    Used so that logs show that such a variable was forwarded, never its value.
    """
    return _SECRET_NAME.search(name) is not None


def redact(name: str, value: str) -> str:
    """Return ``value`` fit for a log line: ``"<redacted>"`` for secret-looking names."""
    return "<redacted>" if looks_secret(name) else value
