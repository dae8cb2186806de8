"""Streaming collection: files start while the rest of the suite is still being collected.

The suites here make the order observable instead of timing it: a "gate"
module, collected after ``test_a.py``, blocks its own import until
``test_a.py`` has run. If collection did not stream, the gate would wait for
its whole bound and record that it waited. These runs have a (simulated)
card, so the collection imports every file; on a machine without cards it
defers them instead (the tests at the end).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

A_RUNS = """
from pathlib import Path

def test_a():
    Path(__file__).with_name("a_ran").write_text("")
"""

A_FAILS = """
from pathlib import Path

def test_a():
    Path(__file__).with_name("a_ran").write_text("")
    assert False, "fails on purpose"
"""


def gate(then: str = "", wait: float = 30.0) -> str:
    """A module whose first import (the collection's) waits until test_a.py has run, then ``then``."""
    return f"""
import os
import time
from pathlib import Path

HERE = Path(__file__).parent
if not (HERE / "gate_seen").exists():
    (HERE / "gate_seen").write_text(str(os.getpid()))
    deadline = time.monotonic() + {hang_guard(wait)!r}
    while not (HERE / "a_ran").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    (HERE / "verdict").write_text("streamed" if (HERE / "a_ran").exists() else "waited")
    {then}

def test_gate():
    pass
"""


def _report(path: Path) -> dict[str, dict]:
    return {Path(f["path"]).name: f for f in json.loads(path.read_text())["files"]}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_file_runs_while_later_files_are_still_being_collected(make_suite, run_gpusched):
    root = make_suite({"test_a.py": A_RUNS, "test_z_gate.py": gate()})
    done = run_gpusched(
        "run", ".", "--simulate-gpus", "1", "--json", "r.json", timeout=hang_guard(120)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "verdict").read_text() == "streamed"
    files = _report(root / "r.json")
    assert {name: f["outcome"] for name, f in files.items()} == {
        "test_a.py": "PASSED",
        "test_z_gate.py": "PASSED",
    }
    assert "2 files on 1 simulated cards" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "gpusched: 2 passed, 0 failed, 0 skipped"


def test_a_collection_error_arrives_while_other_files_already_run(make_suite, run_gpusched):
    root = make_suite(
        {
            "test_a.py": A_RUNS,
            "test_m_gpu.py": "import pytest\n\n@pytest.mark.gpu(1)\ndef test_g():\n    pass\n",
            "test_z_bad.py": gate('raise ImportError("broken on purpose")'),
        }
    )
    done = run_gpusched(
        "run", ".", "--simulate-gpus", "1", "--json", "r.json", timeout=hang_guard(120)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (root / "verdict").read_text() == "streamed"
    files = _report(root / "r.json")
    assert files["test_a.py"]["outcome"] == "PASSED"
    assert files["test_m_gpu.py"]["outcome"] == "PASSED"
    assert files["test_z_bad.py"]["outcome"] == "ERROR"
    assert "broken on purpose" in files["test_z_bad.py"]["tests"][0]["message"]
    assert done.stdout.strip().splitlines()[-1] == "gpusched: 2 passed, 1 failed, 0 skipped"


def test_exitfirst_stops_the_collection_and_starts_nothing_collected_later(
    make_suite, run_gpusched
):
    """-x: a file that failed before collection ended stops the run; the collection is killed."""
    slow = "import time\n\ndef test_slow():\n    time.sleep(1.0)\n"
    root = make_suite(
        {
            "test_a.py": A_FAILS,
            "test_b_slow.py": slow,
            "test_z_gate.py": gate(then="time.sleep(600)", wait=60),
            "test_zz_later.py": "def test_later():\n    pass\n",
        }
    )
    started = time.monotonic()
    done = run_gpusched(
        # Three CPU slots: one is the collection's while it runs, so test_a and test_b start.
        "run", ".", "--simulate-gpus", "1", "--cpu-slots", "3", "-x", "--json", "r.json",
        timeout=hang_guard(120),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert time.monotonic() - started < hang_guard(60)  # it did not wait for the gate
    files = _report(root / "r.json")
    assert files["test_a.py"]["outcome"] == "FAILED"
    assert "test_z_gate.py" not in files and "test_zz_later.py" not in files
    # It started before the failure, and finishes: -x starts no new file and kills none.
    assert files["test_b_slow.py"]["outcome"] == "PASSED"
    collector = int((root / "gate_seen").read_text())
    assert _gone(collector), f"the collection child {collector} outlived the run"
    assert done.stdout.strip().splitlines()[-1].startswith("gpusched: ")


def test_collection_timeout_after_files_started_reports_them_and_exits_3(make_suite, run_gpusched):
    root = make_suite({"test_a.py": A_RUNS, "test_z_gate.py": gate(then="time.sleep(600)")})
    done = run_gpusched(
        "run",
        ".",
        "--simulate-gpus",
        "1",
        "--collect-timeout",
        "5",
        "--json",
        "r.json",
        timeout=hang_guard(120),
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "collection timed out after 5s" in done.stdout
    assert _report(root / "r.json")["test_a.py"]["outcome"] == "PASSED"
    assert _gone(int((root / "gate_seen").read_text()))


def test_selection_is_predicted_per_file_as_plain_pytest_selects(
    make_suite, run_gpusched, run_pytest
):
    """-m and -k are applied to each streamed file as pytest applies them to the whole suite."""
    root = make_suite(
        {
            "test_mix.py": """
                import pytest

                def test_cpu():
                    pass

                @pytest.mark.gpu(2)
                def test_two():
                    pass

                def test_named_x():
                    pass
                """,
            "test_only_gpu.py": "import pytest\n\n@pytest.mark.gpu1\ndef test_g():\n    pass\n",
        }
    )
    for selection in (["-m", "not gpu"], ["-k", "named or test_g"], ["-m", "gpu2"]):
        plain = run_pytest("--collect-only", "-q", *selection)
        expected = sorted(line for line in plain.stdout.splitlines() if "::" in line)
        done = run_gpusched(
            "run", ".", "--simulate-gpus", "2", *selection, "--json", "r.json",
            "--collect-cache", "off",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "files start once collection is done" not in done.stdout  # it streamed
        assert "queued again" not in done.stdout  # no child found a different requirement
        ran = sorted(
            test["nodeid"]
            for entry in json.loads((root / "r.json").read_text())["files"]
            for test in entry["tests"]
        )
        assert ran == expected, selection


def test_nothing_collected_exits_5(make_suite, run_gpusched):
    make_suite({"test_none.py": "x = 1\n", "test_one.py": "def test_one():\n    pass\n"})
    done = run_gpusched("run", ".", "-k", "no_such_test")
    assert done.returncode == 5, done.stdout + done.stderr
    assert "gpusched: no tests collected" in done.stdout


def test_a_conftest_that_changes_the_selection_turns_streaming_off(make_suite, run_gpusched):
    root = make_suite(
        {
            "conftest.py": """
                def pytest_collection_modifyitems(config, items):
                    items[:] = [item for item in items if "drop" not in item.name]
                """,
            "test_a.py": "def test_keep():\n    pass\n\ndef test_drop():\n    pass\n",
        }
    )
    done = run_gpusched("run", ".", "--simulate-gpus", "1", "--json", "r.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "files start once collection is done" in done.stdout
    assert "conftest.py changes the selection" in done.stdout
    tests = [t["nodeid"] for t in _report(root / "r.json")["test_a.py"]["tests"]]
    assert tests == ["test_a.py::test_keep"]


HYPOTHESIS_TEST = """
from hypothesis import given, strategies as st

@given(st.integers())
def test_h(x):
    assert x == x
"""


BENCHMARK_TEST = """
def test_b(benchmark):
    benchmark(sum, [1, 2, 3])
"""


def test_pytest_benchmark_keeps_streaming_on(make_suite, run_gpusched):
    """pytest-benchmark (a test dependency here, as it is on GPU images) implements
    pytest_collection_modifyitems only to add skip markers: files still start while the
    collection runs, and --benchmark-skip skips its tests in their own file's process."""
    import pytest_benchmark.plugin

    assert hasattr(pytest_benchmark.plugin, "pytest_collection_modifyitems")
    root = make_suite({"test_a.py": A_RUNS, "test_b.py": BENCHMARK_TEST, "test_z_gate.py": gate()})
    done = run_gpusched(
        "run", ".", "--simulate-gpus", "1", "--json", "r.json", "--", "--benchmark-skip",
        timeout=hang_guard(120),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "files start once collection is done" not in done.stdout, done.stdout
    assert (root / "verdict").read_text() == "streamed"
    assert _report(root / "r.json")["test_b.py"]["tests"][0]["outcome"] == "skipped"


def test_hypothesis_keeps_streaming_on_unless_m_names_its_marker(make_suite, run_gpusched):
    """Hypothesis (on GPU images; not a dependency here: its plugin adds about 0.6 s to every
    pytest start) adds the `hypothesis` marker in pytest_collection_modifyitems: files
    still start during the collection, unless an -m expression names that marker."""
    plugin = pytest.importorskip("_hypothesis_pytestplugin")
    assert hasattr(plugin, "pytest_collection_modifyitems")
    root = make_suite({"test_a.py": A_RUNS, "test_h.py": HYPOTHESIS_TEST, "test_z_gate.py": gate()})
    done = run_gpusched(
        "run", ".", "--simulate-gpus", "1", "--json", "r.json", timeout=hang_guard(120)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "files start once collection is done" not in done.stdout, done.stdout
    assert (root / "verdict").read_text() == "streamed"
    assert _report(root / "r.json")["test_h.py"]["outcome"] == "PASSED"

    # gate_seen is left: the gate does not wait again.
    done = run_gpusched("run", ".", "--simulate-gpus", "1", "-m", "not hypothesis")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "_hypothesis_pytestplugin.py changes the selection" in done.stdout, done.stdout


def test_the_collection_leaves_no_temporary_file(make_suite, run_gpusched, tmp_path_factory):
    make_suite({"test_a.py": A_RUNS, "test_z_gate.py": gate()})
    tmp = tmp_path_factory.mktemp("tmpdir")
    done = run_gpusched("run", ".", "--simulate-gpus", "1", TMPDIR=str(tmp))
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in tmp.iterdir() if p.name.startswith("gpusched-collect")] == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server needs fork")
def test_streaming_without_the_fork_server(make_suite, run_gpusched):
    root = make_suite({"test_a.py": A_RUNS, "test_z_gate.py": gate()})
    done = run_gpusched(
        "run", ".", "--simulate-gpus", "1", "--fork-server", "off", timeout=hang_guard(120)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "verdict").read_text() == "streamed"


# ---------------------------------------------------------------- no cards: deferred files

IMPORTS = """
import os
from pathlib import Path

with open(Path(__file__).with_name("imports.log"), "a") as log:
    log.write(f"{Path(__file__).name} {os.environ.get('GPUSCHED_JOB_TAG', '')}\\n")
"""


def _importers(root: Path) -> list[tuple[str, str]]:
    """(file, who) for each import of a test module: "collect" or "run" (a file's own child)."""
    lines = (
        (root / "imports.log").read_text().splitlines() if (root / "imports.log").exists() else []
    )
    (root / "imports.log").unlink(missing_ok=True)
    return sorted(
        (name, "collect" if tag.startswith("collect-") else "run")
        for name, _, tag in (line.partition(" ") for line in lines)
    )


def test_without_cards_each_file_is_imported_once_by_its_own_run(make_suite, run_gpusched):
    """The collection defers what the cache does not know; the next run knows every file."""
    root = make_suite(
        {
            "test_a.py": IMPORTS + "\ndef test_a():\n    pass\n",
            "test_b.py": IMPORTS + "\ndef test_b1():\n    pass\n\ndef test_b2():\n    pass\n",
        }
    )
    first = run_gpusched("run", ".", "--json", "r.json")
    assert first.returncode == 0, first.stdout + first.stderr
    assert _importers(root) == [("test_a.py", "run"), ("test_b.py", "run")]
    tests = {n: [t["nodeid"] for t in f["tests"]] for n, f in _report(root / "r.json").items()}
    assert tests == {
        "test_a.py": ["test_a.py::test_a"],
        "test_b.py": ["test_b.py::test_b1", "test_b.py::test_b2"],
    }
    cache = json.loads((root / ".gpusched" / "collection.json").read_text())["files"]
    assert cache["test_b.py"]["tests"] == ["test_b.py::test_b1", "test_b.py::test_b2"]
    second = run_gpusched("run", ".")
    assert second.returncode == 0, second.stdout + second.stderr
    assert _importers(root) == [("test_a.py", "run"), ("test_b.py", "run")]
    assert second.stdout.strip().splitlines()[-1] == "gpusched: 3 passed, 0 failed, 0 skipped"


def test_with_a_card_the_collection_imports_each_file(make_suite, run_gpusched):
    root = make_suite({"test_a.py": IMPORTS + "\ndef test_a():\n    pass\n"})
    done = run_gpusched("run", ".", "--simulate-gpus", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _importers(root) == [("test_a.py", "collect"), ("test_a.py", "run")]


def test_a_deferred_file_with_no_selected_test_is_not_reported(make_suite, run_gpusched):
    root = make_suite(
        {"test_a.py": "def test_keep():\n    pass\n", "test_b.py": "def test_other():\n    pass\n"}
    )
    done = run_gpusched("run", ".", "-k", "keep", "--json", "r.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(_report(root / "r.json")) == ["test_a.py"]
    assert "DESELECTED  test_b.py (no test selected)" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "gpusched: 1 passed, 0 failed, 0 skipped"
    everything = run_gpusched("run", ".", "-k", "no_such_test")
    assert everything.returncode == 5, everything.stdout + everything.stderr
    assert "gpusched: no tests collected" in everything.stdout


def test_a_deferred_file_that_fails_to_import_is_a_collection_error_every_time(
    make_suite, run_gpusched
):
    root = make_suite(
        {"test_a.py": "def test_a():\n    pass\n", "test_bad.py": "import nosuchmodule\n"}
    )
    for _ in range(2):  # the error is not cached: the second run reports it again
        done = run_gpusched("run", ".", "--json", "r.json")
        assert done.returncode == 1, done.stdout + done.stderr
        bad = _report(root / "r.json")["test_bad.py"]
        assert (bad["outcome"], bad["message"]) == ("ERROR", "collection error")
        assert "nosuchmodule" in bad["tests"][0]["message"]
