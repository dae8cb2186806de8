"""The ``lookup`` tool of the embedded ``lookup`` task: a table the model never sees.

Each episode gets its own random table (``tools_kwargs["lookup"]["table"]``,
made by :func:`trainer.data.tasks.lookup_example`), so the answer cannot be
learned from prompts: only a call with the right key reveals it.
"""

from __future__ import annotations

from typing import Any

from trainer.rollout.tools.base import Tool


class LookupTool(Tool):
    """``lookup(key) -> value`` in this episode's hidden table; rewards asking for the right key.

    ``key`` is optional: without it the tool looks up the key the episode's
    question is about, so the shortest right call is ``lookup()``.
    """

    name = "lookup"
    description = (
        "Look up the value stored under an integer key in a hidden table "
        "(default: the key the question asks about)."
    )
    parameters = {
        "type": "object",
        "properties": {"key": {"type": "integer", "description": "the key to look up"}},
        "required": [],
    }

    async def create(self, table: dict[str, str] | None = None, key: int | None = None, **_: Any):
        """State: the episode's table and the key its question is about."""
        if not table:
            raise ValueError("lookup needs tools_kwargs.lookup.table (a dict key -> value)")
        return {"table": {str(k): str(v) for k, v in table.items()}, "key": key, "asked": []}

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        key = str(arguments.get("key", state["key"]))
        if key not in state["table"]:
            raise KeyError(f"no key {key}")
        state["asked"].append(key)
        return state["table"][key]

    async def reward(self, state: dict[str, Any]) -> float:
        """1.0 if the episode looked up the key its question asks about, else 0.0."""
        return 1.0 if str(state["key"]) in state["asked"] else 0.0
