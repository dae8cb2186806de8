"""``rl_e2e.untraced_imports``: unmeasured modules import without coverage's tracer, and
what is measured stays the same.

Each case runs a script in a fresh interpreter under ``coverage run`` (a real
CTracer on Python 3.11), on two packages of a temp dir: ``mine`` is measured,
``lib`` is not; ``lib``'s body imports ``mine.inner``, so a measured module is
imported from inside an unmeasured one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_e2e import untraced_imports

coverage = pytest.importorskip("coverage")

PACKAGES = {
    "mine/__init__.py": "",
    "mine/top.py": "import sys\nTRACED = sys.gettrace() is not None\nimport lib\n\n\n"
    "def used():\n    return lib.value()\n\n\ndef unused():\n    return 0\n",
    "mine/inner.py": "import sys\nTRACED = sys.gettrace() is not None\n\n\n"
    "def helper():\n    return 1\n",
    "lib/__init__.py": "import sys\nTRACED = sys.gettrace() is not None\n"
    "import mine.inner\nAFTER = sys.gettrace() is not None\n\n\n"
    "def value():\n    return mine.inner.helper() + 1\n",
}

SCRIPT = """\
import json, sys, threading
if sys.argv[1] == "install":
    from rl_e2e.untraced_imports import install
    install()
seen = {}
def other_thread():
    import mine.other
    seen["other"] = mine.other.TRACED
thread = threading.Thread(target=other_thread)
import mine.top, mine.inner, lib
thread.start(); thread.join()
assert mine.top.used() == 2
seen.update(
    top=mine.top.TRACED, inner=mine.inner.TRACED, lib=lib.TRACED, lib_after=lib.AFTER,
    back=sys.gettrace() is not None,
    loader=type(lib.__loader__).__name__, spec_loader=type(lib.__spec__.loader).__name__,
)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for name, text in {**PACKAGES, "mine/other.py": PACKAGES["mine/inner.py"]}.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    (root / "script.py").write_text(SCRIPT)
    return root


def _measure(repo: Path, mode: str, source: str) -> tuple[dict, dict[str, list[int]]]:
    data = repo / f".coverage.{mode}.{source.replace('=', '')}"
    rc = repo / f"rc.{source.replace('=', '')}"
    rc.write_text(f"[run]\n{source}\n")
    done = subprocess.run(
        [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", f"--data-file={data}",
         "script.py", mode],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    measured = coverage.CoverageData(basename=str(data))
    measured.read()
    lines = {
        Path(name).relative_to(repo).as_posix(): sorted(measured.lines(name) or [])
        for name in measured.measured_files()
    }
    return json.loads(done.stdout.splitlines()[-1]), lines


@pytest.mark.parametrize("source", ["source = mine", "source_pkgs = mine"])
def test_unmeasured_bodies_run_untraced_and_the_measured_lines_do_not_change(repo, source):
    traced, lines = _measure(repo, "plain", source)
    quiet, quiet_lines = _measure(repo, "install", source)
    assert lines == quiet_lines
    assert set(lines) == {"mine/__init__.py", "mine/top.py", "mine/inner.py", "mine/other.py"}
    assert 11 not in lines["mine/top.py"]  # unused()'s body never ran: still missing
    # Without the finder every body runs traced; with it only lib's does not, and a
    # measured module imported from lib's body is traced again, then lib's is not.
    assert traced == {
        "top": True, "inner": True, "lib": True, "lib_after": True, "other": True, "back": True,
        "loader": "SourceFileLoader", "spec_loader": "SourceFileLoader",
    }  # fmt: skip
    assert quiet == {**traced, "lib": False, "lib_after": False}


def test_without_coverage_the_finder_changes_nothing(repo):
    done = subprocess.run(
        [sys.executable, "script.py", "install"],
        cwd=repo, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["loader"] == seen["spec_loader"] == "SourceFileLoader"
    assert not any(seen[key] for key in ("top", "inner", "lib", "lib_after", "other", "back"))


def test_install_is_once_and_uninstall_removes_it():
    was = untraced_imports.installed()
    untraced_imports.install()
    untraced_imports.install()
    assert sum(isinstance(f, untraced_imports.UntracedImports) for f in sys.meta_path) == 1
    assert isinstance(sys.meta_path[0], untraced_imports.UntracedImports) or was
    if not was:
        untraced_imports.uninstall()
        assert not untraced_imports.installed()
