"""Find tool calls in an assistant turn's text; one parser per tokenizer family.

- :class:`HermesParser`: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  what Qwen2.5/Qwen3, Hermes and many other chat templates teach their models.
- :class:`CompactParser`: ``~name:arg1,arg2`` on its own line (``~arg1,...``
  when there is one tool), which a character-level tokenizer without letters
  or braces can still spell: the built-in tiny model's form.

A parser never raises on model output: a call it cannot read comes back as a
:class:`ToolCall` with ``error`` set, which the episode loop turns into an
error observation. :func:`select_parser` picks the form from the tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.rollout.tools.base import Tool, property_names

FORMATS = ("auto", "hermes", "compact")


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: a tool name and arguments, or why it is unreadable."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its free text and its tool calls (in order)."""

    content: str
    calls: list[ToolCall]


class ToolCallParser(Protocol):
    """What the episode loop needs: split a turn's text into content and calls."""

    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>`` JSON ``</tool_call>`` blocks; several per turn; content is the rest."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls = [self._call(m.group(1)) for m in self._BLOCK.finditer(text)]
        rest = self._BLOCK.sub("", text)
        if self.OPEN in rest:  # an opened block that never closed
            raw = rest[rest.index(self.OPEN) :]
            calls.append(
                ToolCall(None, error="malformed tool call: <tool_call> not closed", raw=raw)
            )
            rest = rest[: rest.index(self.OPEN)]
        return ParsedTurn(rest.strip(), calls)

    @staticmethod
    def _call(body: str) -> ToolCall:
        raw = body.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ToolCall(None, error=f"malformed tool call: not JSON ({exc.msg})", raw=raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(
                None,
                error='malformed tool call: expected {"name": ..., "arguments": {...}}',
                raw=raw,
            )
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return ToolCall(
                obj["name"], error="malformed tool call: arguments must be an object", raw=raw
            )
        return ToolCall(obj["name"], args, raw=raw)


class CompactParser:
    """Lines ``~name:a,b`` (or ``~a,b`` with one tool); values map onto the schema in order.

    Values are converted to the parameter's JSON type (``integer``,
    ``number``, ``boolean``, else string); a value that does not convert, or
    a number of values outside [required, all parameters], is a malformed
    call (trailing optional parameters may be left out). Text before the
    first ``~`` of a line is content.
    """

    MARK = "~"

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {t.name: t for t in tools}
        self.only = tools[0] if len(tools) == 1 else None

    def parse(self, text: str) -> ParsedTurn:
        content, calls = [], []
        for line in text.split("\n"):
            head, mark, body = line.partition(self.MARK)
            content.append(head)
            if mark:
                calls.append(self._call(body))
        return ParsedTurn("\n".join(content).strip(), calls)

    def _call(self, body: str) -> ToolCall:
        raw = self.MARK + body
        name, colon, values = body.partition(":")
        if not colon:
            if self.only is None:
                return ToolCall(
                    None, error="malformed tool call: expected ~name:arguments", raw=raw
                )
            name, values = self.only.name, body
        tool = self.tools.get(name)
        if tool is None:
            return ToolCall(name, raw=raw)  # unknown tool: reported by the executor
        names = property_names(tool)
        parts = values.split(",") if values.strip() else []
        least = len(tool.parameters.get("required") or [])
        if not least <= len(parts) <= len(names):
            takes = f"{least}-{len(names)}" if least < len(names) else str(len(names))
            return ToolCall(
                name,
                error=f"malformed tool call: {name} takes {takes} argument(s), got {len(parts)}",
                raw=raw,
            )
        args: dict[str, Any] = {}
        for key, part in zip(names, parts, strict=False):
            kind = tool.parameters["properties"][key].get("type")
            try:
                args[key] = _convert(part.strip(), kind)
            except ValueError:
                return ToolCall(
                    name, error=f"malformed tool call: {key}={part!r} is not {kind}", raw=raw
                )
        return ToolCall(name, args, raw=raw)


def _convert(value: str, kind: Any) -> Any:
    if kind == "integer":
        if not re.fullmatch(r"[+-]?\d+", value):
            raise ValueError(value)
        return int(value)
    if kind == "number":
        return float(value)
    if kind == "boolean":
        if value not in ("true", "false"):
            raise ValueError(value)
        return value == "true"
    return value


def _vocab_has(tokenizer: Any, token: str) -> bool:
    vocab = tokenizer.get_vocab()
    return token in vocab or token in getattr(tokenizer, "additional_special_tokens", [])


def resolve_format(fmt: str, tokenizer: Any) -> str:
    """The concrete form for ``rollout.multi_turn.format=fmt`` and this tokenizer.

    ``auto``: ``hermes`` when the tokenizer has a ``<tool_call>`` token or its
    chat template mentions one (Qwen2.5, Qwen3, Hermes); else ``compact`` when
    the tokenizer can spell ``~`` (the tiny character tokenizer); else an
    error asking for an explicit choice.
    """
    if fmt not in FORMATS:
        raise ValueError(f"rollout.multi_turn.format={fmt!r}: choose one of {FORMATS}")
    if fmt != "auto":
        return fmt
    template = getattr(tokenizer, "chat_template", None) or ""
    if _vocab_has(tokenizer, HermesParser.OPEN) or HermesParser.OPEN in str(template):
        return "hermes"
    ids = tokenizer(CompactParser.MARK, add_special_tokens=False)["input_ids"]
    if ids and tokenizer.unk_token_id not in ids:
        return "compact"
    raise ValueError(
        "rollout.multi_turn.format=auto: this tokenizer has no <tool_call> token and cannot "
        "spell '~'; set rollout.multi_turn.format=hermes or compact"
    )


def select_parser(fmt: str, tokenizer: Any, tools: list[Tool]) -> ToolCallParser:
    """The parser for ``rollout.multi_turn.format`` (see :func:`resolve_format`)."""
    if resolve_format(fmt, tokenizer) == "hermes":
        return HermesParser()
    return CompactParser(tools)
