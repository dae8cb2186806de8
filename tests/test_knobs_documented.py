"""Every TRAINER_* / GPUSCHED_* variable the code reads has a row in the reference's table.

A knob is found two ways: a string literal that is exactly such a name anywhere
in ``trainer/``, ``gpusched/`` or ``rl_e2e/`` (whether read directly, through an ``env_*``
helper or via a constant), and the ``GPUSCHED_*`` variables gpusched derives
from its option table (``gpusched.options.OPTIONS``). The reverse holds too: a
row for a variable nothing reads is stale documentation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("trainer", "gpusched", "rl_e2e")
KNOB = re.compile(r"(?:TRAINER|GPUSCHED)_[A-Z0-9_]+")
ROW = re.compile(r"^\|\s*`([A-Z0-9_]+)`\s*\|")
PAGE = ROOT / "docs" / "reference.md"
SECTION = "## Environment variables"


def knobs_in_source(root: Path, dirs: tuple[str, ...] = SOURCE_DIRS) -> dict[str, list[str]]:
    """Map each knob-shaped string literal in ``root/dirs/**.py`` to where it appears."""
    found: dict[str, list[str]] = {}
    for directory in dirs:
        for path in sorted((root / directory).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and KNOB.fullmatch(node.value)
                ):
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.setdefault(node.value, []).append(where)
    return found


def option_knobs() -> dict[str, list[str]]:
    """The ``GPUSCHED_*`` variables of gpusched's option table (names built at run time)."""
    from gpusched.options import OPTIONS

    return {option.env: [f"gpusched/options.py ({option.flags[0]})"] for option in OPTIONS}


def knob_table(page: str) -> dict[str, list[str]]:
    """Rows of the ``## Environment variables`` section (up to the next ``## ``): name -> cells."""
    lines = page.splitlines()
    try:
        start = lines.index(SECTION)
    except ValueError:
        raise AssertionError(f"{PAGE} has no '{SECTION}' section") from None
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        match = ROW.match(line)
        if match:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[match.group(1)] = cells
    return rows


@pytest.fixture(scope="module")
def table() -> dict[str, list[str]]:
    return knob_table(PAGE.read_text())


@pytest.fixture(scope="module")
def knobs() -> dict[str, list[str]]:
    return {**knobs_in_source(ROOT), **option_knobs()}


def test_every_knob_read_is_documented(knobs, table):
    missing = {name: where for name, where in sorted(knobs.items()) if name not in table}
    assert not missing, f"knobs read but missing from {PAGE.name} '{SECTION}': " + "; ".join(
        f"{name} (read at {', '.join(where)})" for name, where in missing.items()
    )


def test_every_documented_knob_is_read(knobs, table):
    stale = sorted(set(table) - set(knobs))
    assert not stale, f"{PAGE.name} '{SECTION}' documents variables nothing reads: {stale}"


def test_every_row_has_default_reader_and_meaning(table):
    incomplete = [name for name, cells in table.items() if len(cells) != 4 or not all(cells)]
    assert not incomplete, f"rows need name | default | read by | meaning: {incomplete}"


def test_scanner_finds_reads_and_ignores_prose(tmp_path):
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        '"""Set TRAINER_IN_PROSE=1 to do nothing."""\n'
        "import os\n"
        "from rl_e2e.knobs import env_int\n"
        'A = os.environ.get("TRAINER_DIRECT")\n'
        'B = env_int("TRAINER_VIA_HELPER", 1)\n'
        'NAME = "GPUSCHED_VIA_CONSTANT"\n'
        'PREFIX = "TRAINER_"\n'
        'LOWER = "trainer_lower"\n'
    )
    found = knobs_in_source(tmp_path, ("trainer",))
    assert sorted(found) == ["GPUSCHED_VIA_CONSTANT", "TRAINER_DIRECT", "TRAINER_VIA_HELPER"]
    assert found["TRAINER_DIRECT"] == ["trainer/mod.py:4"]


def test_table_parser_stops_at_next_section():
    page = (
        "## Environment variables\n\n| Variable | Default | Read by | Meaning |\n|---|---|---|---|\n"
        "| `TRAINER_A` | 1 | driver | a |\n\n## Next\n\n| `TRAINER_B` | 2 | worker | b |\n"
    )
    assert knob_table(page) == {"TRAINER_A": ["`TRAINER_A`", "1", "driver", "a"]}


def test_every_run_option_has_a_row_in_the_gpusched_guide():
    from gpusched.options import OPTIONS

    guide = (ROOT / "docs" / "gpusched.md").read_text()
    rows = {
        line.split("|")[3].strip().strip("`")
        for line in guide.splitlines()
        if "| `GPUSCHED_" in line
    }
    missing = [option.flags[0] for option in OPTIONS if option.env not in rows]
    assert not missing, f"docs/gpusched.md's options table lacks rows for {missing}"
