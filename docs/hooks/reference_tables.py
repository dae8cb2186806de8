"""MkDocs hook: the reference tables are generated from the code, so they cannot go stale.

A line ``{{ gpusched_options }}`` in a page becomes the table of ``gpusched run``
options (from ``gpusched.options.OPTIONS``); ``{{ rl_e2e_options }}`` the e2e plugin's
ini options (from ``rl_e2e.settings.OPTIONS``); ``{{ trainer_config }}`` becomes the
table of ``python -m trainer`` keys (from ``trainer.config.Config``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def gpusched_options_table() -> str:
    """One row per option: flags, ``[tool.gpusched]`` key, variable, default, meaning."""
    from gpusched.options import OPTIONS

    rows = [
        "| option | `[tool.gpusched]` key | variable | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        flags = ", ".join(
            f"`{flag}`" + (f" {option.metavar}" if option.metavar else "") for flag in option.flags
        )
        default = "none" if option.default is None else f"`{option.default}`"
        rows.append(
            f"| {flags} | `{option.name}` | `{option.env}` | {default} | {_cell(option.help)} |"
        )
    return "\n".join(rows)


def trainer_config_table() -> str:
    """One row per ``Config`` key: dotted name, type, default, docstring."""
    from trainer.cli_help import config_keys
    from trainer.config import Config

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key in config_keys(Config()):
        rows.append(f"| `{key.name}` | `{key.type}` | `{_cell(key.default)}` | {_cell(key.help)} |")
    return "\n".join(rows)


def rl_e2e_options_table() -> str:
    """One row per ini option of the rl_e2e plugin: name, type, default, meaning."""
    from rl_e2e.settings import OPTIONS

    rows = ["| ini option | type | default | meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        default = f"`{option.default}`" if option.default not in ("", []) else "none"
        rows.append(f"| `{option.name}` | {option.type} | {default} | {_cell(option.help)} |")
    return "\n".join(rows)


TABLES = {
    "{{ gpusched_options }}": gpusched_options_table,
    "{{ rl_e2e_options }}": rl_e2e_options_table,
    "{{ trainer_config }}": trainer_config_table,
}


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    for placeholder, make in TABLES.items():
        if placeholder in markdown:
            markdown = markdown.replace(placeholder, make())
    return markdown
