"""The ``Tool`` interface and the checks every call's arguments go through.

A tool is a class with a ``name``, a description and an OpenAI-format JSON
schema of its parameters, and an ``async execute(arguments, state) -> str``.
The episode loop (:mod:`trainer.rollout.episode_loop`) owns one ``state`` per
episode and tool: :meth:`Tool.create` makes it when the episode starts (with
the example's ``tools_kwargs[name]``), :meth:`Tool.reward` reads it when the
episode ends (the reward function receives the value), :meth:`Tool.release`
frees it. Whatever a tool raises becomes an error observation the model
sees: a tool never ends a step.
"""

from __future__ import annotations

from typing import Any

#: JSON-schema type name -> the Python types a value of that type may have.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolArgumentError(ValueError):
    """Arguments that do not match the tool's schema (shown to the model, counted as an error)."""


class Tool:
    """Base class of tools: override ``name``, ``parameters`` and :meth:`execute`.

    ``parameters`` is the JSON schema of the arguments object (``type``
    ``object``, ``properties``, ``required``); the order of ``properties`` is
    the order of positional arguments in the compact call form. Tools must be
    ``async`` all the way: blocking work belongs in ``asyncio.to_thread``, or
    it stalls every other episode's tools and escapes the timeout.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema handed to ``apply_chat_template(tools=...)``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def create(self, **kwargs: Any) -> dict[str, Any]:
        """Per-episode state, from the example's ``tools_kwargs[self.name]`` (default: a copy)."""
        return dict(kwargs)

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        """Run one call and return the observation text the model will read."""
        raise NotImplementedError(f"tool {self.name!r} does not implement execute")

    async def reward(self, state: dict[str, Any]) -> float:
        """A reward the tool grants the episode (passed to the reward function); 0 by default."""
        return 0.0

    async def release(self, state: dict[str, Any]) -> None:
        """Free what :meth:`create` took (sandboxes, files); nothing by default."""


def property_names(tool: Tool) -> list[str]:
    """Names of the tool's parameters in schema order."""
    return list((tool.parameters.get("properties") or {}).keys())


def check_arguments(tool: Tool, arguments: Any) -> dict[str, Any]:
    """``arguments`` if they fit the tool's schema, else :class:`ToolArgumentError` saying why.

    Checks what a model gets wrong: not an object, a missing required
    argument, an unknown one, a value of the wrong JSON type (booleans are not
    integers). Nested schemas are not descended into.
    """
    if not isinstance(arguments, dict):
        raise ToolArgumentError(
            f"arguments of {tool.name} must be an object, got {type(arguments).__name__}"
        )
    props = tool.parameters.get("properties") or {}
    missing = [k for k in tool.parameters.get("required") or [] if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{tool.name}: missing argument(s) {', '.join(missing)}")
    unknown = [k for k in arguments if k not in props]
    if unknown:
        raise ToolArgumentError(f"{tool.name}: unknown argument(s) {', '.join(unknown)}")
    for key, value in arguments.items():
        kind = props[key].get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed is None:
            continue
        if (isinstance(value, bool) and kind != "boolean") or not isinstance(value, allowed):
            raise ToolArgumentError(
                f"{tool.name}: argument {key} must be {kind}, got {type(value).__name__}"
            )
    return arguments


def validate_tool(tool: Any, where: str) -> Tool:
    """``tool`` if it has what the loop needs; ``TypeError`` naming ``where`` otherwise."""
    if not isinstance(tool, Tool):
        raise TypeError(f"{where}: {tool!r} is not a trainer.rollout.tools.Tool")
    if not isinstance(tool.name, str) or not tool.name:
        raise TypeError(f"{where}: the tool has no name (set the class attribute 'name')")
    params = tool.parameters
    if not isinstance(params, dict) or params.get("type") != "object":
        raise TypeError(f"{where}: {tool.name}.parameters must be a JSON schema of type 'object'")
    if not isinstance(params.get("properties", {}), dict):
        raise TypeError(f"{where}: {tool.name}.parameters['properties'] must be an object")
    return tool
