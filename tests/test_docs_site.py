"""The documentation site builds in strict mode, and what a user reads first stays a guide.

``mkdocs build --strict`` fails on any warning: a page missing from the nav, a
link to a page or an anchor that does not exist, a reference table that cannot
be generated from the code, a docstring mkdocstrings cannot find.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import hang_guard

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = [sys.executable, "-m", "mkdocs"]
README_MAX_LINES = 250

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (extra 'docs')"
)


def _build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            *MKDOCS,
            "build",
            "--strict",
            "--config-file",
            str(project / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )


def _copy_project(tmp_path: Path) -> Path:
    """The docs, their config, the changelog and the code they document, in ``tmp_path``."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(ROOT / "docs", project / "docs")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, project / name)
    for package in ("gpusched", "trainer", "rl_e2e"):
        (project / package).symlink_to(ROOT / package)
    return project


def test_site_builds_strictly_with_generated_reference(tmp_path):
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    from gpusched.options import OPTIONS

    for option in OPTIONS:  # the options table came from the code
        assert option.env in reference
    assert "trainer.total_steps" in reference  # so did the config keys
    assert "execute" in reference  # the Tool API, from its docstrings
    assert (tmp_path / "site" / "changelog" / "index.html").exists()


@pytest.mark.parametrize(
    "link, complaint",
    [
        ("[gone](no-such-page.md)", "no-such-page.md"),
        ("[gone](benchmarks.md#no-such-section)", "#no-such-section"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path, link, complaint):
    project = _copy_project(tmp_path)
    index = project / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee {link}.\n")
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0
    assert complaint in done.stdout + done.stderr


def test_a_page_outside_the_nav_fails_the_build(tmp_path):
    project = _copy_project(tmp_path)
    (project / "docs" / "orphan.md").write_text("# Orphan\n")
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0
    assert "orphan.md" in done.stdout + done.stderr


def test_readme_is_short_and_names_no_issue_or_session():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = re.findall(
            r"(?i)\bissue #?\d+|\bsession \d+|#\d{1,3}\b(?!\])|<!--", page.read_text()
        )
        assert not found, f"{page.name}: {found}"
