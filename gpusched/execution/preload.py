"""What the fork server may pre-import, and whether this platform may fork at all.

Pure decisions over paths and sources (the server does the importing):
the automatic preload list is the set of third-party packages that the
suite's ``conftest.py`` files import at module level, the imports every
child would otherwise pay for. Local packages (those under the rootdir) are
never preloaded: their import runs the suite's own code, which may touch
CUDA, threads or the environment, and belongs in each child.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

SCAN_DEPTH = 2  # conftest.py files this many directories below a given path are read too


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
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names: list[str] = []

    def visit(statements: Iterable[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.extend(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module.split(".")[0])
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)

    visit(tree.body)
    return list(dict.fromkeys(names))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


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
    if name in sys.stdlib_module_names or name == "__future__":
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    locations = [spec.origin] if spec.origin else []
    locations += list(spec.submodule_search_locations or [])
    root = rootdir.resolve()
    for location in locations:
        if location in (None, "built-in", "frozen"):
            continue
        resolved = Path(location).resolve()
        installed = any(part in ("site-packages", "dist-packages") for part in resolved.parts)
        if not installed and (resolved == root or root in resolved.parents):
            return False
    return bool(locations)


def auto_preload(paths: Sequence[str], rootdir: Path) -> list[str]:
    """The third-party packages the suite's conftest files import at module level."""
    names: list[str] = []
    for conftest in conftest_files(paths, rootdir):
        try:
            source = conftest.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        names += [n for n in module_level_imports(source) if n not in names]
    return [name for name in names if is_third_party(name, rootdir)]


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
