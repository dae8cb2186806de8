"""What a source file imports from installed packages when it is imported, through the suite's own modules.

A test module rarely imports ``torch`` itself: it imports the project's
``trainer.workers.actor``, which imports ``torch``, ``ray`` and
``tensordict`` at module level. This follows module-level imports (the same
statements ``module_level_imports`` reads: also inside ``try``/``if``, not
under ``TYPE_CHECKING``, not inside functions) from file to file through
the local sources (packages under the rootdir, and modules beside the
importing file, where pytest's default import mode finds them) and stops at
packages that are installed: their imports are what it reports. Nothing is imported;
sources are parsed. Imports inside functions are not followed, so what a file
imports lazily is missed, never invented.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# A top-level name's kind: installed (third party), local (its source path), or neither.
_Kind = tuple[str, Path | None]
THIRD_PARTY = "third"
LOCAL = "local"
NEITHER = "neither"


def import_statements(source: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """Module-level imports as ``(level, module, names)``: ``from ..a import b, c`` is
    ``(2, "a", ("b", "c"))``, ``import a.b`` is ``(0, "a.b", ())``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[tuple[int, str, tuple[str, ...]]] = []

    def visit(statements: Iterable[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend((0, alias.name, ()) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                names = tuple(alias.name for alias in node.names if alias.name != "*")
                found.append((node.level, node.module or "", names))
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)

    visit(tree.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_file(base: Path, parts: Iterable[str]) -> Path | None:
    """``base/a/b.py`` or ``base/a/b/__init__.py`` for parts ``a, b``; None if neither exists."""
    path = base.joinpath(*parts)
    for candidate in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_inits(base: Path, parts: list[str]) -> Iterator[Path]:
    """The ``__init__.py`` files that importing ``base/parts...`` runs on the way down."""
    for depth in range(1, len(parts)):
        init = base.joinpath(*parts[:depth]) / "__init__.py"
        if init.is_file():
            yield init


def _local_imports(base: Path, parts: list[str], names: tuple[str, ...]) -> list[Path]:
    """The files ``from base/parts import names`` runs (``import base/parts`` without names):
    the packages' ``__init__.py`` on the way, the module, and each name that is a submodule."""
    found = list(_package_inits(base, parts))
    target = _module_file(base, parts) if parts else None
    if target is not None:
        found.append(target)
    for name in names:
        sub = _module_file(base, [*parts, name])
        if sub is not None:
            found.append(sub)
    return [path.resolve() for path in found]


class ImportGraph:
    """Local sources and the installed packages each one reaches; parses every file once.

    ``classify`` says what a top-level name is: ``("third", None)`` for an
    installed package, ``("local", dir)`` for one whose source is under ``dir``
    (the directory holding the package or module), ``("neither", None)``
    otherwise (standard library, missing). It is consulted once per name; the
    default (``classify_with_importlib``) looks the name up with ``importlib``,
    which for a top-level name imports nothing.
    """

    def __init__(self, classify: Callable[[str], _Kind]) -> None:
        self._classify = classify
        self._kinds: dict[str, _Kind] = {}
        self._edges: dict[Path, tuple[frozenset[str], tuple[Path, ...]]] = {}

    def reached(self, path: Path) -> frozenset[str]:
        """What importing ``path`` imports from installed packages at module level, transitively.

        Each import is named as the statement makes it: ``import a.b`` is ``"a.b"``,
        ``from a.b import c`` is ``"a.b:c"`` (``c`` may be an attribute, resolved lazily by
        some libraries, or a submodule): importing ``transformers`` alone leaves most of
        what ``from transformers import LlamaForCausalLM`` costs still to do.
        """
        seen: set[Path] = set()
        packages: set[str] = set()
        stack = [path.resolve()]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            direct, local = self._file(current)
            packages |= direct
            stack.extend(local)
        return frozenset(packages)

    def _file(self, path: Path) -> tuple[frozenset[str], tuple[Path, ...]]:
        if path not in self._edges:
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                source = ""
            third: set[str] = set()
            local: list[Path] = []
            for level, module, names in import_statements(source):
                if level:
                    self._relative(path, level, module, names, local)
                else:
                    self._absolute(path, module, names, third, local)
            self._edges[path] = (frozenset(third), tuple(dict.fromkeys(local)))
        return self._edges[path]

    def _relative(
        self, path: Path, level: int, module: str, names: tuple[str, ...], local: list[Path]
    ) -> None:
        base = path.parent
        for _ in range(level - 1):
            base = base.parent
        local.extend(_local_imports(base, module.split(".") if module else [], names))

    def _absolute(
        self, path: Path, module: str, names: tuple[str, ...], third: set[str], local: list[Path]
    ) -> None:
        parts = module.split(".")
        kind, where = self._kind(parts[0], path)
        if kind == THIRD_PARTY:
            if names:
                third.update(f"{module}:{name}" for name in names)
            else:
                third.add(module)
        elif kind == LOCAL and where is not None:
            local.extend(_local_imports(where, parts, names))

    def _kind(self, top: str, importer: Path) -> _Kind:
        # Beside a file outside any package (a test file, a conftest), a module of that
        # directory wins: pytest's default "prepend" import mode puts the directory
        # first on sys.path. Inside a package, imports are absolute.
        beside = importer.parent
        if not (beside / "__init__.py").is_file() and _module_file(beside, [top]) is not None:
            return (LOCAL, beside)
        if top not in self._kinds:
            self._kinds[top] = self._classify(top)
        return self._kinds[top]


def classify_with_importlib(rootdir: Path) -> Callable[[str], _Kind]:
    """The default ``classify`` of ``ImportGraph`` for a suite under ``rootdir``: source under
    ``rootdir`` (and not in a ``site-packages`` there) is local, the standard library and
    names not found are neither, anything else found is third party."""
    root = rootdir.resolve()

    def classify(top: str) -> _Kind:
        if top in sys.stdlib_module_names or top == "__future__":
            return (NEITHER, None)
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return (NEITHER, None)
        if spec is None:
            return (NEITHER, None)
        if spec.submodule_search_locations:
            location = Path(next(iter(spec.submodule_search_locations)))
        elif spec.origin and spec.has_location:
            location = Path(spec.origin)
        else:
            return (NEITHER, None)
        resolved = location.resolve()
        installed = any(part in ("site-packages", "dist-packages") for part in resolved.parts)
        if not installed and (root == resolved or root in resolved.parents):
            return (LOCAL, resolved.parent)
        return (THIRD_PARTY, None)

    return classify
