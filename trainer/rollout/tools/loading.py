"""Load tools named in ``rollout.multi_turn.tools``, the way reward functions are loaded.

Each entry is ``package.module:Class``, ``package.module.Class`` or
``/path/to/file.py:Class`` (a class, instantiated without arguments, or an
already-built :class:`~trainer.rollout.tools.base.Tool` instance).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.data.rewards import import_object
from trainer.rollout.tools.base import Tool, validate_tool

KEY = "rollout.multi_turn.tools"


def load_tool(spec: str) -> Tool:
    """The tool ``spec`` names; errors name the config key, the spec and what is wrong."""
    obj = import_object(spec, KEY, "tool")
    where = f"{KEY}: {spec!r}"
    if isinstance(obj, type):
        if not issubclass(obj, Tool):
            raise TypeError(f"{where}: {obj.__name__} does not subclass trainer.rollout.tools.Tool")
        try:
            obj = obj()
        except TypeError as exc:
            raise TypeError(f"{where}: cannot instantiate {obj.__name__}(): {exc}") from exc
    return validate_tool(obj, where)


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """All tools of ``specs``, in order; two tools with one name are an error."""
    tools = [load_tool(s) for s in specs]
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{KEY}: several tools are named {', '.join(dupes)}")
    return tools
