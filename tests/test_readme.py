"""The README's Quickstart is what CI runs: two commands, the second one in .ci/run verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quickstart_is_exactly_two_commands_that_set_up_first():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert all(command.startswith("bash setup.sh && ") for command in commands)


def test_ci_runs_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci_lines
