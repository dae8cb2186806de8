"""The "Command line" sections of the guides show what the commands really print.

Each ``$ `` line of a console block there is run from the repository root;
its output must be the lines under it, or contain them in order where the
block elides with ``...``. Version numbers are compared by form only: the
version is pyproject.toml's, and a release changes it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import hang_guard

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.compile(r"^(gpusched|trainer) \S+", re.M)


def console_examples(page: Path) -> list[tuple[str, list[str]]]:
    """(command, output lines) for each ``$ `` line in the page's "## Command line" section."""
    text = page.read_text()
    assert "\n## Command line\n" in text, f"{page.name} has no '## Command line' section"
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    examples: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            else:
                examples[-1][1].append(line)
    return examples


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "gpusched":
        return [sys.executable, "-m", "gpusched", *argv[1:]]
    assert argv[0] == "python", command
    return [sys.executable, *argv[1:]]


EXAMPLES = [
    pytest.param(command, shown, id=f"{page}: {command}")
    for page in ("gpusched.md", "trainer.md")
    for command, shown in console_examples(ROOT / "docs" / page)
]


@pytest.mark.parametrize(("command", "shown"), EXAMPLES)
def test_a_documented_command_prints_what_the_guide_shows(command, shown):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "PYTEST_"))}
    done = subprocess.run(
        _argv(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard(30)
    )
    printed = VERSION.sub(r"\1 VERSION", done.stdout + done.stderr).splitlines()
    shown = VERSION.sub(r"\1 VERSION", "\n".join(shown)).splitlines()
    if "..." not in shown:
        assert printed == shown
        return
    excerpt = [line for line in shown if line != "..."]
    found = iter(printed)
    missing = [line for line in excerpt if line not in found]  # in order: `in` consumes
    assert not missing, f"{command}: not printed (in this order): {missing}"
