"""The collection cache: unchanged files are not imported by the collection, and stale
predictions are caught by the file's own child and run on the right cards."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpusched.collection.cache import (
    CachedFile,
    cache_payload,
    conftest_chain,
    file_key,
    parse_cache,
    remembered,
)
from gpusched.requirements import Requirement
from gpusched.results import expectation, parse_expectation

# Each import of a test module appends its name to the file named by IMPORTS.
COUNTED = (
    'import os\nwith open(os.environ["IMPORTS"], "a") as log:\n    log.write(__name__ + "\\n")\n'
)


def _imports(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


# --- pure parts -------------------------------------------------------------------------------


def test_a_key_changes_with_the_file_its_conftests_and_the_base():
    key = file_key("base", b"def test(): pass", [b"import torch"])
    assert key == file_key("base", b"def test(): pass", [b"import torch"])
    assert key != file_key("base", b"def test(): pass  ", [b"import torch"])
    assert key != file_key("base", b"def test(): pass", [b"import numpy"])
    assert key != file_key("base", b"def test(): pass", [])
    assert key != file_key("other", b"def test(): pass", [b"import torch"])


def test_conftest_chain_lists_every_conftest_above_the_file(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for conftest in (tmp_path / "conftest.py", tmp_path / "a" / "b" / "conftest.py"):
        conftest.write_text("")
    chain = conftest_chain(tmp_path / "a" / "b" / "test_x.py")
    assert chain[:2] == [tmp_path / "a" / "b" / "conftest.py", tmp_path / "conftest.py"]


def test_an_expectation_round_trips_and_sees_the_test_list():
    text = expectation(Requirement(2, 40 * 10**9), ["t.py::a", "t.py::b"])
    requirement, tests = parse_expectation(text)
    assert requirement == Requirement(2, 40 * 10**9)
    assert tests != parse_expectation(expectation(Requirement(2, 40 * 10**9), ["t.py::a"]))[1]
    assert parse_expectation(expectation(Requirement(), []))[0] == Requirement()


def test_a_malformed_cache_is_empty_and_bad_entries_are_dropped():
    assert parse_cache(None) == {}
    assert parse_cache({"version": 99, "files": {}}) == {}
    good = CachedFile("k", Requirement(1), ("t.py::a",), (Requirement(1),))
    payload = cache_payload({"t.py": good})
    payload["files"]["bad.py"] = {"key": "k", "gpus": "two"}
    assert parse_cache(payload) == {"t.py": good}


def test_remembered_stores_paths_relative_to_the_rootdir_and_skips_outsiders(tmp_path):
    entry = CachedFile("k", Requirement(), ("tests/t.py::a",), (Requirement(),))
    updated = remembered(
        {"old.py": entry},
        [(str(tmp_path / "tests" / "t.py"), entry), ("/elsewhere/t.py", entry)],
        [(str(tmp_path / "tests" / "empty.py"), "e")],
        tmp_path,
    )
    assert set(updated) == {"old.py", "tests/t.py", "tests/empty.py"}
    assert updated["tests/empty.py"].tests == ()


# --- real runs --------------------------------------------------------------------------------


# With a card the collection imports every file it has no valid entry for; without one it
# defers them (tests/gpusched/test_streaming.py).
CARD = ("--simulate-gpus", "1")


def test_an_unchanged_file_is_imported_only_by_its_own_child(make_suite, run_gpusched, tmp_path):
    make_suite(
        {
            "tests/conftest.py": "",
            "tests/test_one.py": COUNTED + "\ndef test_a():\n    pass\n",
            "tests/test_two.py": COUNTED + "\ndef test_b():\n    pass\n",
        }
    )
    log = tmp_path / "imports.log"
    first = run_gpusched("run", "tests", *CARD, "--json", "report.json", IMPORTS=str(log))
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(_imports(log)) == ["test_one", "test_one", "test_two", "test_two"]

    log.unlink()
    second = run_gpusched("run", "tests", *CARD, "--json", "report.json", IMPORTS=str(log))
    assert second.returncode == 0, second.stdout + second.stderr
    assert sorted(_imports(log)) == ["test_one", "test_two"]  # the children only
    assert _report(tmp_path)["summary"]["passed"] == 2

    log.unlink()
    (tmp_path / "tests" / "test_two.py").write_text(
        COUNTED + "\ndef test_b():\n    pass\n\n\ndef test_c():\n    pass\n"
    )
    third = run_gpusched("run", "tests", *CARD, "--json", "report.json", IMPORTS=str(log))
    assert third.returncode == 0, third.stdout + third.stderr
    assert sorted(_imports(log)) == ["test_one", "test_two", "test_two"]  # edited: collected
    assert _report(tmp_path)["summary"]["passed"] == 3

    log.unlink()
    (tmp_path / "tests" / "conftest.py").write_text("# changed\n")
    fourth = run_gpusched("run", "tests", *CARD, "--json", "report.json", IMPORTS=str(log))
    assert fourth.returncode == 0, fourth.stdout + fourth.stderr
    assert sorted(_imports(log)) == ["test_one", "test_one", "test_two", "test_two"]

    log.unlink()
    off = run_gpusched(
        "run", "tests", "--collect-cache", "off", "--json", "report.json", IMPORTS=str(log)
    )
    assert off.returncode == 0, off.stdout + off.stderr
    assert len(_imports(log)) == 4


def test_a_selection_change_is_a_different_cache_key(make_suite, run_gpusched, tmp_path):
    make_suite(
        {
            "tests/test_m.py": COUNTED
            + "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n\n\n"
            + "def test_fast():\n    pass\n"
        }
    )
    log = tmp_path / "imports.log"
    assert run_gpusched("run", "tests", *CARD, IMPORTS=str(log)).returncode == 0
    log.unlink()
    picked = run_gpusched(
        "run", "tests", *CARD, "-m", "not slow", "--json", "report.json", IMPORTS=str(log)
    )
    assert picked.returncode == 0, picked.stdout + picked.stderr
    assert len(_imports(log)) == 2  # collected again under the new selection
    tests = [t["nodeid"] for f in _report(tmp_path)["files"] for t in f["tests"]]
    assert tests == ["tests/test_m.py::test_fast"]


def test_a_stale_prediction_is_run_again_on_the_cards_the_file_needs(
    make_suite, run_gpusched, tmp_path
):
    """The marker lives in a helper module the key cannot see: the child catches it."""
    make_suite(
        {
            "tests/helpers.py": "import pytest\nneeds = pytest.mark.gpu(1)\n",
            "tests/test_gpu.py": """
                import os
                from helpers import needs

                @needs
                def test_cards():
                    with open(os.environ["SEEN"], "a") as log:
                        log.write(os.environ["CUDA_VISIBLE_DEVICES"] + "\\n")
                """,
        }
    )
    seen = tmp_path / "seen.log"
    first = run_gpusched("run", "tests", "--simulate-gpus", "2", SEEN=str(seen))
    assert first.returncode == 0, first.stdout + first.stderr
    assert len(seen.read_text().split()[0].split(",")) == 1

    helpers = tmp_path / "tests" / "helpers.py"
    helpers.write_text("import pytest\nneeds = pytest.mark.gpu(2)\n")
    # An edit a second later, as a person's would be: Python trusts a cached .pyc of the
    # same size and modification second, and the first run may have written one.
    os.utime(helpers, (time.time() + 2, time.time() + 2))
    seen.unlink()
    second = run_gpusched(
        "run", "tests", "--simulate-gpus", "2", "--json", "report.json", SEEN=str(seen)
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert len(seen.read_text().split()) == 1  # the test ran once, not on the wrong card first
    assert len(seen.read_text().split()[0].split(",")) == 2
    (file,) = _report(tmp_path)["files"]
    assert len(file["cards"]) == 2 and file["attempts"] == 1 and file["outcome"] == "PASSED"
    cache = json.loads((tmp_path / ".gpusched" / "collection.json").read_text())
    assert "tests/test_gpu.py" not in cache["files"]  # forgotten: the next run collects it


def test_a_changed_test_list_from_a_helper_is_taken_from_the_child(
    make_suite, run_gpusched, tmp_path
):
    make_suite(
        {
            "tests/helpers.py": "CASES = [1, 2]\n",
            "tests/test_p.py": """
                import os
                import pytest
                from helpers import CASES

                @pytest.mark.parametrize("n", CASES)
                def test_n(n):
                    if os.environ.get("CRASH") == str(n):
                        os._exit(3)
                """,
        }
    )
    assert run_gpusched("run", "tests").returncode == 0
    (tmp_path / "tests" / "helpers.py").write_text("CASES = [1, 2, 3, 4]\n")
    crashed = run_gpusched("run", "tests", "--json", "report.json", CRASH="2")
    assert crashed.returncode == 1
    (file,) = _report(tmp_path)["files"]
    outcomes = {t["nodeid"].split("[")[1].rstrip("]"): t["outcome"] for t in file["tests"]}
    # The tests past the crash are the child's own list, not the cache's two.
    assert outcomes == {"1": "passed", "2": "crashed", "3": "not run", "4": "not run"}


def test_naming_one_file_runs_only_that_file_when_its_neighbours_are_cached(
    make_suite, run_gpusched, tmp_path
):
    """pytest makes a node for every file of a directory it walks: cached neighbours stay out."""
    make_suite({f"tests/test_{n}.py": "def test_it():\n    pass\n" for n in "abc"})
    assert run_gpusched("run", "tests").returncode == 0
    one = run_gpusched("run", "tests/test_b.py", "--json", "report.json")
    assert one.returncode == 0, one.stdout + one.stderr
    assert [f["path"].rsplit("/", 1)[1] for f in _report(tmp_path)["files"]] == ["test_b.py"]
