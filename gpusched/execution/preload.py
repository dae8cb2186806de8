"""What the fork server may pre-import, and whether this platform may fork at all.

Pure decisions over paths and sources (the server does the importing):
the automatic preload list is the set of installed packages that every
child, or many children, would otherwise import for themselves: those the
suite's ``conftest.py`` files bring in at module level, and those that at
least ``SHARED_BY`` test files bring in, directly or through the suite's own
modules (``gpusched.execution.importgraph``). Local packages (those under the
rootdir) are never preloaded: their import runs the suite's own code, which
may touch CUDA, threads or the environment, and belongs in each child.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from gpusched.execution.importgraph import (
    THIRD_PARTY,
    ImportGraph,
    classify_with_importlib,
    import_statements,
)

SCAN_DEPTH = 2  # conftest.py files this many directories below a given path are read too
SHARED_BY = 2  # a package only test files reach is preloaded when this many of them reach it
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")  # pytest's default ``python_files``
# pytest's default ``norecursedirs``, and what a test walk never needs to enter.
SKIPPED_DIRS = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}",
                "__pycache__", "site-packages")  # fmt: skip


def fork_unavailable(platform: str = sys.platform) -> str | None:
    """Why this platform gets no fork server, or None.

    macOS has ``fork`` but its system libraries are not fork-safe (CPython's
    multiprocessing defaults to spawn there); Windows has none.
    """
    if platform.startswith("linux"):
        return None
    if platform == "darwin":
        return "fork is not safe on macOS"
    return f"no safe fork on {platform}"


def module_level_imports(source: str) -> list[str]:
    """Top-level package names imported by statements at module level (also inside ``try``/``if``)."""
    names = [module.split(".")[0] for level, module, _ in import_statements(source) if not level]
    return list(dict.fromkeys(name for name in names if name))


def conftest_files(paths: Sequence[str], rootdir: Path) -> list[Path]:
    """The ``conftest.py`` files pytest will load for ``paths``: ancestors up to ``rootdir``, and below.

    Below a given directory only ``SCAN_DEPTH`` levels are read, so a huge
    tree costs nothing noticeable.
    """
    found: dict[Path, None] = {}
    root = rootdir.resolve()
    for raw in paths or ["."]:
        path = Path(raw.split("::")[0]).resolve()
        start = path if path.is_dir() else path.parent
        chain = [start, *start.parents]
        for directory in reversed(chain):
            inside = directory == root or root in directory.parents
            if inside and (directory / "conftest.py").is_file():
                found[directory / "conftest.py"] = None
        if path.is_dir():
            base_depth = len(path.parts)
            for directory, subdirs, files in os.walk(path):
                depth = len(Path(directory).parts) - base_depth
                subdirs[:] = [d for d in subdirs if not d.startswith((".", "__"))]
                if depth >= SCAN_DEPTH:
                    subdirs[:] = []
                if "conftest.py" in files:
                    found[Path(directory) / "conftest.py"] = None
    return list(found)


def is_third_party(name: str, rootdir: Path) -> bool:
    """Installed, not the standard library, not a package of the suite itself."""
    kind, _ = classify_with_importlib(rootdir)(name)
    return kind == THIRD_PARTY


def find_test_files(paths: Sequence[str]) -> list[Path]:
    """The test modules pytest's default ``python_files`` would find under ``paths`` (a file
    given by name counts whatever its name)."""
    found: dict[Path, None] = {}
    for raw in paths or ["."]:
        path = Path(raw.split("::")[0])
        if path.is_file() and path.suffix == ".py":
            found[path.resolve()] = None
        elif path.is_dir():
            for directory, subdirs, files in os.walk(path):
                subdirs[:] = sorted(d for d in subdirs if not _skipped(d))
                for name in sorted(files):
                    if any(fnmatch.fnmatch(name, pattern) for pattern in TEST_FILE_PATTERNS):
                        found[(Path(directory) / name).resolve()] = None
    return list(found)


def _skipped(directory: str) -> bool:
    return any(fnmatch.fnmatch(directory, pattern) for pattern in SKIPPED_DIRS)


def auto_preload(
    paths: Sequence[str], rootdir: Path, graph: ImportGraph | None = None
) -> list[str]:
    """The installed packages worth importing once for every child, in import order.

    First those the conftest files bring in (every child imports them; in the
    order the conftests name them, then those reached through local modules),
    then those at least ``SHARED_BY`` test files bring in, most shared first.
    """
    graph = graph or ImportGraph(classify_with_importlib(rootdir))
    names: list[str] = []
    for conftest in conftest_files(paths, rootdir):
        try:
            source = conftest.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        reached = graph.reached(conftest)
        names += [n for n in module_level_imports(source) if n in reached and n not in names]
        names += sorted(n for n in reached if n not in names)
    shared = Counter(name for path in find_test_files(paths) for name in graph.reached(path))
    names += [
        name
        for name, count in sorted(shared.items(), key=lambda item: (-item[1], item[0]))
        if count >= SHARED_BY and name not in names
    ]
    return names


ROOT_MARKERS = ("pyproject.toml", "pytest.ini", "tox.ini", "setup.cfg")


def guess_rootdir(paths: Sequence[str], cwd: Path) -> Path:
    """Where pytest's rootdir will probably be: the nearest ancestor of the paths with a config file.

    Only bounds the conftest scan; collection finds the real one.
    """
    resolved = [Path(raw.split("::")[0]).resolve() for raw in paths or ["."]]
    dirs = [path if path.is_dir() else path.parent for path in resolved]
    common = Path(os.path.commonpath([str(d) for d in dirs])) if dirs else cwd.resolve()
    for directory in [common, *common.parents]:
        if any((directory / marker).is_file() for marker in ROOT_MARKERS):
            return directory
    return common
