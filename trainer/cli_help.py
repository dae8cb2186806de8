"""The keys of the trainer's configuration, read from its dataclasses: for help and for typos.

A key is a dotted path to a field of :class:`trainer.config.Config`
(``trainer.total_steps``); its help is the field's docstring, the string
literal written right after the field. :func:`config_keys` lists every key
with its type, default and help; ``python -m trainer --help`` prints them with
:func:`format_keys`, and :func:`load_config` names the nearest keys of a
mistyped one with :func:`suggest`. Nothing here imports the trainer: the
functions take the dataclasses (or an instance) they describe.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Key:
    """One settable key: ``name`` is dotted, ``section`` is the dotted path of its dataclass."""

    name: str
    section: str
    type: str
    default: Any
    help: str


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after that field in ``cls``'s class body.

    Empty when the source cannot be read (a frozen or zipped install); fields
    without a literal have no entry.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def config_keys(config: Any, prefix: str = "") -> list[Key]:
    """Every leaf key of the dataclass instance ``config`` (its values are the defaults).

    A section's own keys come before its nested sections, each in declaration order.
    """
    cls = type(config)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    own: list[Key] = []
    nested: list[Key] = []
    for f in dataclasses.fields(cls):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            nested += config_keys(value, f"{prefix}{f.name}.")
        else:
            own.append(
                Key(
                    prefix + f.name,
                    prefix.rstrip("."),
                    _type_name(hints[f.name]),
                    value,
                    docs.get(f.name, ""),
                )
            )
    return own + nested


def section_docs(config: Any, prefix: str = "") -> dict[str, str]:
    """Dotted section -> the docstring of the field that holds it (``actor.optim`` -> ...)."""
    docs = field_docs(type(config))
    found: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            if docs.get(f.name):
                found[prefix + f.name] = docs[f.name]
            found.update(section_docs(value, f"{prefix}{f.name}."))
    return found


def format_value(value: Any) -> str:
    """A default as it is written on the command line (``true``, ``[]``, ``[0.9,0.99]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    if value == "":
        return "''"
    return str(value)


def format_keys(keys: Iterable[Key], sections: dict[str, str], width: int = 79) -> str:
    """Keys grouped by section: ``  key: type = default`` then the help, indented and wrapped."""
    lines: list[str] = []
    current: str | None = None
    for key in keys:
        if key.section != current:
            current = key.section
            lines += ["", f"{current or 'top level'}:"]
            if sections.get(current):
                lines += _wrap(sections[current], "  ", width)
        lines.append(f"  {key.name}: {key.type} = {format_value(key.default)}")
        if key.help:
            lines += _wrap(key.help, "      ", width)
    return "\n".join(lines).lstrip("\n")


def _wrap(text: str, indent: str, width: int) -> list[str]:
    return textwrap.wrap(
        " ".join(text.split()),
        width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def suggest(key: str, names: Iterable[str]) -> list[str]:
    """Keys a mistyped ``key`` probably meant: those with the same last part, else the closest.

    ``actor.lr`` -> ``actor.optim.lr``, ``critic.optim.lr``;
    ``trainer.totl_steps`` -> ``trainer.total_steps`` (difflib's close matches).
    """
    names = list(names)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [name for name in names if name.rsplit(".", 1)[-1] == leaf and name != key]
    return same_leaf[:3] or difflib.get_close_matches(key, names, n=1)


def did_you_mean(candidates: list[str]) -> str:
    """``"; did you mean 'a'?"``, ``"; did you mean 'a' or 'b'?"``, or ``""`` for none."""
    if not candidates:
        return ""
    quoted = [f"'{name}'" for name in candidates]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"; did you mean {listed}?"
