"""What the fork server preloads: installed packages reached through the suite's own modules.

Pure: sources are written to a temporary tree and parsed, never imported
(``heavylib`` and friends do not exist; a fake ``classify`` says what is
installed), except where ``classify_with_importlib`` is tested on real names.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from gpusched.execution.importgraph import (
    LOCAL,
    NEITHER,
    THIRD_PARTY,
    ImportGraph,
    classify_with_importlib,
    import_statements,
)
from gpusched.execution.preload import SHARED_BY, auto_preload, find_test_files

INSTALLED = {"heavylib", "otherlib", "lazylib", "typinglib", "cyclelib", "helperlib", "pytest"}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def fake_graph(root: Path) -> ImportGraph:
    """``proj`` is the suite's package under ``root``; the names in INSTALLED are installed."""

    def classify(top: str) -> tuple[str, Path | None]:
        if top in INSTALLED:
            return (THIRD_PARTY, None)
        if (root / top).is_dir():
            return (LOCAL, root)
        return (NEITHER, None)

    return ImportGraph(classify)


PROJECT = {
    "proj/__init__.py": "import json\n",
    "proj/models/__init__.py": "from .net import Net\n",
    "proj/models/net.py": """
        import heavylib.nn as nn
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import typinglib

        def build():
            import lazylib
        """,
    "proj/workers.py": """
        try:
            import otherlib
        except ImportError:
            otherlib = None
        from proj import models
        from . import cycle
        """,
    "proj/cycle.py": "import cyclelib\nfrom proj.workers import otherlib\n",
}


def test_import_statements_keep_level_module_and_names():
    source = "import a.b, c\nfrom ..d import e, f\nfrom . import g\nfrom h import *\n"
    assert import_statements(source) == [
        (0, "a.b", ()),
        (0, "c", ()),
        (2, "d", ("e", "f")),
        (1, "", ("g",)),
        (0, "h", ()),
    ]
    assert import_statements("def broken(:\n") == []


def test_a_test_reaches_what_the_local_modules_it_imports_import(tmp_path):
    write(tmp_path, PROJECT)
    write(tmp_path, {"tests/test_w.py": "from proj.workers import otherlib\n"})
    graph = fake_graph(tmp_path)
    # proj.workers -> otherlib, proj.models (-> net -> heavylib), proj.cycle (-> cyclelib,
    # and back to proj.workers: the cycle ends). Not the lazy import, not the typing one.
    assert graph.reached(tmp_path / "tests/test_w.py") == {"otherlib", "heavylib.nn", "cyclelib"}


def test_a_package_init_on_the_way_counts_and_a_plain_import_of_a_submodule_too(tmp_path):
    write(tmp_path, PROJECT)
    write(tmp_path, {"tests/test_n.py": "import proj.models.net\n"})
    # proj/models/__init__.py runs first and imports .net: heavylib either way
    assert fake_graph(tmp_path).reached(tmp_path / "tests/test_n.py") == {"heavylib.nn"}


def test_a_helper_beside_the_test_file_is_followed_first(tmp_path):
    write(
        tmp_path,
        {
            "tests/helpers.py": "import helperlib\n",
            "tests/test_h.py": "import helpers\nimport pytest\n",
        },
    )
    assert fake_graph(tmp_path).reached(tmp_path / "tests/test_h.py") == {"helperlib", "pytest"}


def test_a_from_import_of_an_installed_package_names_what_it_takes(tmp_path):
    write(
        tmp_path,
        {"tests/test_f.py": "from heavylib.models import Big, Small\nimport otherlib.sub\n"},
    )
    # the names matter: a library that resolves attributes lazily imports their modules then
    assert fake_graph(tmp_path).reached(tmp_path / "tests/test_f.py") == {
        "heavylib.models:Big",
        "heavylib.models:Small",
        "otherlib.sub",
    }


def test_inside_a_package_a_sibling_does_not_shadow_an_absolute_import(tmp_path):
    write(
        tmp_path,
        {
            "proj/__init__.py": "",
            "proj/helperlib/__init__.py": "import heavylib\n",  # proj.helperlib, not helperlib
            "proj/user.py": "import helperlib\n",
            "tests/test_u.py": "import proj.user\n",
        },
    )
    assert fake_graph(tmp_path).reached(tmp_path / "tests/test_u.py") == {"helperlib"}


def test_names_that_are_neither_local_nor_installed_are_ignored(tmp_path):
    write(tmp_path, {"tests/test_x.py": "import os\nimport missing_thing\nfrom proj import x\n"})
    assert fake_graph(tmp_path).reached(tmp_path / "tests/test_x.py") == frozenset()


def test_classify_with_importlib_on_real_names(tmp_path, monkeypatch):
    (tmp_path / "mylocal").mkdir()
    (tmp_path / "mylocal" / "__init__.py").write_text("")
    (tmp_path / "single.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    classify = classify_with_importlib(tmp_path)
    assert classify("pytest") == (THIRD_PARTY, None)
    assert classify("json") == (NEITHER, None)
    assert classify("surely_not_installed_xyz") == (NEITHER, None)
    assert classify("mylocal") == (LOCAL, tmp_path.resolve())
    assert classify("single") == (LOCAL, tmp_path.resolve())
    assert "mylocal" not in sys.modules  # looked up, never imported


def test_find_test_files_follows_pytest_defaults_and_skip_environments(tmp_path):
    write(
        tmp_path,
        {
            "tests/test_a.py": "",
            "tests/b_test.py": "",
            "tests/helper.py": "",
            "tests/sub/test_c.py": "",
            "tests/.venv/lib/test_venv.py": "",
            "tests/node_modules/test_js.py": "",
            "tests/build/test_built.py": "",
            "other/check_given.py": "",
        },
    )
    found = find_test_files(
        [str(tmp_path / "tests"), str(tmp_path / "other/check_given.py") + "::t"]
    )
    names = sorted(path.relative_to(tmp_path.resolve()).as_posix() for path in found)
    assert names == [
        "other/check_given.py",
        "tests/b_test.py",
        "tests/sub/test_c.py",
        "tests/test_a.py",
    ]


def test_auto_preload_takes_the_conftests_and_what_enough_test_files_share(tmp_path):
    assert SHARED_BY == 2
    write(tmp_path, PROJECT)
    write(
        tmp_path,
        {
            "tests/conftest.py": "import pytest\nfrom proj import cycle\n",
            "tests/test_one.py": "import proj.models\n",
            "tests/test_two.py": "from proj.models.net import build\n",
            "tests/test_three.py": "import proj.models\nimport helperlib\n",
            "tests/test_four.py": "import lazylib\n",
        },
    )
    names = auto_preload([str(tmp_path / "tests")], tmp_path, fake_graph(tmp_path))
    # The conftest's in its own order, then what it reaches (through proj.cycle, which
    # imports proj.workers: otherlib, and proj.models: heavylib); helperlib and lazylib
    # are each reached by one test file only.
    assert names == ["pytest", "cyclelib", "heavylib.nn", "otherlib"]


def test_auto_preload_orders_shared_packages_most_shared_first(tmp_path):
    write(
        tmp_path,
        {
            "tests/test_1.py": "import otherlib\nimport heavylib\n",
            "tests/test_2.py": "import otherlib\nimport heavylib\n",
            "tests/test_3.py": "import otherlib\n",
            "tests/test_4.py": "import lazylib\n",
        },
    )
    names = auto_preload([str(tmp_path / "tests")], tmp_path, fake_graph(tmp_path))
    assert names == ["otherlib", "heavylib"]
