"""Reward functions: built-in rules and loading user functions by name.

A reward function is plain Python, ``reward(completion, ground_truth, **extra)
-> float``, with the result in [0, 1]. Users plug theirs in with
``reward.function=package.module:function`` (or ``package.module.function``) or
``reward.function=/path/to/file.py:function``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., float]


def exact_match(completion: str, ground_truth: str, **extra: Any) -> float:
    """1.0 when the stripped completion equals the ground truth, else 0.0."""
    return float(completion.strip() == ground_truth.strip())


def char_match(completion: str, ground_truth: str, **extra: Any) -> float:
    """Partial credit: characters equal at the same position over the longer length.

    ``sum_i [c_i == g_i] / max(len(c), len(g))``: 1.0 only for an exact match;
    too long or too short answers lose credit for every missing or extra char.
    Whitespace counts (padding an answer with spaces is not a way to stop).
    """
    c, g = completion, ground_truth
    if not c and not g:
        return 1.0
    hits = sum(a == b for a, b in zip(c, g, strict=False))
    return hits / max(len(c), len(g))


def import_object(spec: str, key: str, what: str = "attribute") -> Any:
    """Resolve ``spec`` to the object it names; errors name ``key`` (the config key) and ``spec``.

    Accepted forms: ``/path/to/file.py:name``, ``package.module:name``,
    ``package.module.name``. Shared by reward functions and tools.
    """
    if not spec or not isinstance(spec, str):
        raise ValueError(f"{key}={spec!r}: expected 'module:name' or 'file.py:name'")
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
    elif "." in spec:
        where, name = spec.rsplit(".", 1)
    else:
        raise ValueError(f"{key}={spec!r}: expected 'module:name', 'module.name' or 'file.py:name'")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise FileNotFoundError(f"{key}={spec!r}: file {where!r} does not exist")
        mod_name = "_trainer_user_" + os.path.splitext(os.path.basename(where))[0]
        file_spec = importlib.util.spec_from_file_location(mod_name, where)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"{key}={spec!r}: cannot import {where!r}")
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ImportError(f"{key}={spec!r}: cannot import module {where!r}: {exc}") from exc
    obj = getattr(module, name, None)
    if obj is None:
        raise AttributeError(f"{key}={spec!r}: {where!r} has no {what} {name!r}")
    return obj


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``spec`` to a callable.

    Accepted forms: ``/path/to/file.py:function``, ``package.module:function``,
    ``package.module.function``. Errors name the spec and what is wrong.
    """
    fn = import_object(spec, "reward.function", "callable")
    if not callable(fn):
        raise AttributeError(f"reward.function={spec!r}: has no callable {fn!r}")
    params = inspect.signature(fn).parameters
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    if len(positional) < 2 and not has_varargs:
        raise TypeError(
            f"reward.function={spec!r}: must accept (completion, ground_truth, **extra), "
            f"got signature {inspect.signature(fn)}"
        )
    return fn


def score(fn: RewardFn, completion: str, ground_truth: str, **extra: Any) -> float:
    """Call ``fn`` and check its result is a finite number in [0, 1]."""
    value = fn(completion, ground_truth, **extra)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward function {fn!r} returned {value!r}, expected a float") from None
    if not 0.0 <= out <= 1.0:
        raise ValueError(f"reward function {fn!r} returned {out}, expected a value in [0, 1]")
    return out
