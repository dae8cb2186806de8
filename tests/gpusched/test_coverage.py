"""Coverage under ``gpusched run``: pytest-cov's measurement of every file, combined once.

Acceptance tests run the real command on a small package and its tests in a
temp dir and read the combined data file with coverage's own API; the pure
parts (which arguments measure, how reports and node paths are resolved) are
tested directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import coverage
import pytest

from gpusched.coverage.combine import missing_lines, node_mapper, reports, split_versions
from gpusched.coverage.data import Attempt, attempts, coverage_env, pack, unpack
from gpusched.coverage.request import coverage_requested, measures, option_value
from gpusched.options import UsageError

MODULE = """
def f{i}(x):
    if x > 0:
        return x + {i}
    return -x
"""
TEST = """
import pytest
from pkg.m{i} import f{i}
{marker}

def test_positive():
    assert f{i}(1) == 1 + {i}

def test_negative():
    assert f{i}(-2) == 2
"""


def package_suite(make_suite, count: int, gpu_files: int = 0) -> Path:
    """``pkg/m<i>.py`` and ``tests/test_m<i>.py`` (each test covers all of its module's
    lines); the first ``gpu_files`` test files need a GPU."""
    files = {"pkg/__init__.py": "", "pyproject.toml": ""}
    for i in range(count):
        files[f"pkg/m{i}.py"] = MODULE.format(i=i)
        marker = "pytestmark = pytest.mark.gpu1" if i < gpu_files else ""
        files[f"tests/test_m{i}.py"] = TEST.format(i=i, marker=marker)
    return make_suite(files)


def executed(root: Path, data_file: str = ".coverage") -> dict[str, set[int]]:
    """Lines the data file says ran, by path relative to ``root``."""
    data = coverage.CoverageData(str(root / data_file))
    data.read()
    return {
        os.path.relpath(path, root): set(data.lines(path) or ()) for path in data.measured_files()
    }


def test_every_files_data_is_combined_and_reported_once(make_suite, run_gpusched, tmp_path):
    package_suite(make_suite, 8, gpu_files=3)
    result = run_gpusched(
        "run", "tests", "--simulate-gpus", "2", "--", "--cov=pkg", "--cov-report=term-missing"
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert result.stdout.splitlines()[-1] == "gpusched: 16 passed, 0 failed, 0 skipped", out
    assert result.stdout.count("tests coverage") == 1, out
    [total] = [line.split() for line in result.stdout.splitlines() if line.startswith("TOTAL")]
    assert total == ["TOTAL", "32", "0", "100%"], out
    assert "INTERNALERROR" not in out
    lines = executed(tmp_path)
    for i in range(8):
        assert lines[f"pkg/m{i}.py"] == {2, 3, 4, 5}, (i, lines)
    # One data file, the one pytest-cov leaves; no file's own report in its log.
    assert sorted(p.name for p in tmp_path.glob(".coverage*")) == [".coverage"]
    for log in (tmp_path / ".gpusched" / "logs").glob("tests_*.log"):
        assert "coverage:" not in log.read_text(), log


def test_options_from_addopts_and_file_reports(make_suite, run_gpusched, tmp_path):
    package_suite(make_suite, 3)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "--cov=pkg --cov-report=xml:cov.xml '
        '--cov-report=json --cov-branch"\n'
    )
    result = run_gpusched("run", "tests")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Coverage XML written to file cov.xml" in result.stdout, out
    assert "Coverage JSON written to file coverage.json" in result.stdout, out
    assert "TOTAL" not in result.stdout  # no term report was asked for
    report = json.loads((tmp_path / "coverage.json").read_text())
    assert report["meta"]["branch_coverage"] is True
    assert report["totals"]["percent_covered"] == 100.0
    assert (tmp_path / "cov.xml").read_text().count('filename="m') == 3


def test_fail_under_fails_a_run_whose_tests_pass(make_suite, run_gpusched):
    package_suite(make_suite, 2)
    (Path(make_suite({})) / "tests" / "test_m1.py").write_text(
        "from pkg.m1 import f1\n\ndef test_positive():\n    assert f1(1) == 2\n"
    )
    result = run_gpusched("run", "tests", "--", "--cov=pkg", "--cov-fail-under=95")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert result.stdout.splitlines()[-1] == "gpusched: 3 passed, 0 failed, 0 skipped", out
    assert "FAIL Required test coverage of 95% not reached. Total coverage: 87.50%" in out
    met = run_gpusched("run", "tests", "--", "--cov=pkg", "--cov-fail-under=80")
    assert met.returncode == 0, met.stdout + met.stderr
    assert "Required test coverage of 80% reached. Total coverage: 87.50%" in met.stdout


def test_a_timed_out_file_keeps_what_it_measured_and_a_killed_one_is_named(
    make_suite, run_gpusched, tmp_path
):
    package_suite(make_suite, 2)
    make_suite(
        {
            # Only the timed-out files cover f0's negative branch and f1's.
            "tests/test_m0.py": """
                import time
                from pkg.m0 import f0

                def test_slow():
                    assert f0(1) == 1 and f0(-2) == 2
                    time.sleep(120)
            """,
            "tests/test_m1.py": """
                import signal, time
                from pkg.m1 import f1

                def test_deaf():
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only KILL ends it
                    assert f1(-2) == 2
                    time.sleep(120)
            """,
        }
    )
    result = run_gpusched(
        "run", "tests", "--timeout", "5", "--kill-grace", "1", "--", "--cov=pkg", timeout=180
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "gpusched: coverage: no data from 1 file(s), killed before they could save it: " in out
    assert out.count("tests/test_m1.py") >= 1
    lines = executed(tmp_path)
    assert lines["pkg/m0.py"] == {2, 3, 4, 5}, lines  # saved when the runner TERMed it
    assert not lines.get("pkg/m1.py"), lines  # its only file was killed before it could save


def test_every_attempt_of_a_rerun_file_counts(make_suite, run_gpusched, tmp_path):
    package_suite(make_suite, 1)
    make_suite(
        {
            "tests/test_m0.py": """
                import os
                from pkg.m0 import f0

                def test_flaky(tmp_path_factory):
                    mark = os.path.join(os.path.dirname(__file__), "tried")
                    if not os.path.exists(mark):
                        open(mark, "w").close()
                        assert f0(-2) == 3  # the first attempt fails, on the negative branch
                    assert f0(1) == 1
            """
        }
    )
    result = run_gpusched("run", "tests", "--reruns", "1", "--", "--cov=pkg")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "FLAKY" in result.stdout, out
    assert executed(tmp_path)["pkg/m0.py"] == {2, 3, 4, 5}


def test_append_keeps_the_data_file_and_no_cov_on_fail(make_suite, run_gpusched, tmp_path):
    package_suite(make_suite, 2)
    first = run_gpusched("run", "tests/test_m0.py", "--", "--cov=pkg")
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_gpusched("run", "tests/test_m1.py", "--", "--cov=pkg", "--cov-append")
    assert second.returncode == 0, second.stdout + second.stderr
    lines = executed(tmp_path)
    assert lines["pkg/m0.py"] == lines["pkg/m1.py"] == {2, 3, 4, 5}
    (tmp_path / "tests" / "test_m1.py").write_text("def test_fails():\n    assert False\n")
    failed = run_gpusched("run", "tests", "--", "--cov=pkg", "--no-cov-on-fail")
    assert failed.returncode == 1
    assert "tests coverage" not in failed.stdout, failed.stdout


def test_coverage_off_changes_nothing_in_the_files(make_suite, run_gpusched, tmp_path):
    make_suite(
        {
            "test_env.py": """
                import json, os, sys

                def test_env():
                    seen = {k: v for k, v in os.environ.items() if "COVERAGE" in k}
                    seen["imported"] = "gpusched.coverage.child" in sys.modules
                    open("seen.json", "w").write(json.dumps(seen))
            """
        }
    )
    result = run_gpusched("run", ".")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "seen.json").read_text()) == {"imported": False}
    assert not list(tmp_path.glob(".coverage*"))


def test_a_measured_file_imports_libraries_untraced_and_a_pytest_it_starts_does_not(
    make_suite, run_gpusched, tmp_path
):
    make_suite(
        {
            "pkg/__init__.py": "",
            "tests/test_nested.py": """
                import json, subprocess, sys

                NESTED = (
                    "import sys, pytest\\n"
                    "pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', 'nothing'])\\n"
                    "print('rl_e2e' in sys.modules)\\n"
                )

                def test_nested(tmp_path):
                    from rl_e2e.untraced_imports import installed

                    (tmp_path / "nothing").mkdir()
                    nested = subprocess.run(
                        [sys.executable, "-c", NESTED], cwd=tmp_path, capture_output=True,
                        text=True, check=True,
                    )
                    seen = {"here": installed(), "nested": nested.stdout.split()[-1]}
                    open("seen.json", "w").write(json.dumps(seen))
            """,
        }
    )
    result = run_gpusched("run", "tests", "--", "--cov=pkg")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "seen.json").read_text()) == {"here": True, "nested": "False"}


def test_a_coverage_config_that_cannot_be_read_is_a_usage_error(make_suite, run_gpusched):
    package_suite(make_suite, 1)
    result = run_gpusched("run", "tests", "--", "--cov=pkg", "--cov-config=missing.cfg")
    assert result.returncode == 4, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.cfg" in lines[0], result.stderr


def test_cov_without_pytest_cov_names_the_package(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest_cov" else real(name)
    )
    with pytest.raises(UsageError, match=r"pip install pytest-cov"):
        coverage_requested(["."], ["--cov=pkg"], {}, tmp_path)
    assert not coverage_requested(["."], ["-q"], {}, tmp_path)  # not asked: nothing needed


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (["--cov"], True),
        (["--cov=pkg", "-q"], True),
        (["--cov", "pkg"], True),
        (["-q"], False),
        (["--cov-report=term"], False),
        (["--cov=pkg", "--no-cov"], False),
        (["--no-cov", "--cov=pkg"], False),
        (["--cov=pkg", "--cov-reset"], False),
        (["--cov=pkg", "--cov-reset", "--cov=other"], True),
        (["--cov=pkg", "-p", "no:cov"], False),
        (["--cov=pkg", "-pno:pytest_cov"], False),
        (["--cov=pkg", "-p", "no:cacheprovider"], True),
    ],
)
def test_which_arguments_measure(tokens, expected):
    assert measures(tokens) is expected


def test_addopts_and_environment_are_read_in_pytests_order(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --cov=pkg\n")
    assert coverage_requested(["."], [], {}, tmp_path)
    assert not coverage_requested(["."], ["--no-cov"], {}, tmp_path)
    assert not coverage_requested(["."], [], {"PYTEST_ADDOPTS": "-p no:cov"}, tmp_path)
    (tmp_path / "other.ini").write_text("[pytest]\naddopts = -q\n")
    assert not coverage_requested(["."], ["-c", "other.ini"], {}, tmp_path)
    assert option_value(["-c", "a", "--config-file=b"], "-c", "--config-file") == "b"


def test_reports_as_pytest_cov_resolves_them():
    assert reports({"report": ["term"]}) == {"term": None}
    assert reports({"report": {}}) == {}
    assert reports({"report": {"html": "out", "term-missing": "skip-covered"}}) == {
        "html": "out",
        "term-missing": "skip-covered",
    }
    assert reports({}) == {"term": None}


def test_node_paths_map_to_the_drivers_checkout():
    remap = node_mapper("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_1", "/src")
    assert (
        remap("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_1/pkg/m.py")
        == "/src/pkg/m.py"
    )
    assert remap("/usr/lib/python3/x.py") == "/usr/lib/python3/x.py"
    assert remap("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_10/a.py") == (
        "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_10/a.py"
    )


def test_a_node_with_another_coverage_is_named_and_left_out(tmp_path):
    ours = Attempt(tmp_path, {"coverage": coverage.__version__, "file": "a.py"}, [], "n1")
    theirs = Attempt(tmp_path, {"coverage": "6.0", "file": "b.py"}, [], "n2")
    kept, lines = split_versions([ours, theirs], coverage.__version__)
    assert kept == [ours]
    assert lines == [
        f"gpusched: coverage: node n2 measured with coverage 6.0, this machine has "
        f"{coverage.__version__}: its data is left out"
    ]


def test_only_files_none_of_whose_attempts_saved_data_are_named(tmp_path):
    data = tmp_path / ".coverage"
    first = Attempt(tmp_path, {"file": "tests/a.py"}, [], "")
    second = Attempt(tmp_path, {"file": "tests/a.py"}, [data], "")
    killed = Attempt(tmp_path, {"file": "tests/b.py"}, [], "")
    assert missing_lines([first, second], str) == []
    assert missing_lines([first, second, killed], str) == [
        "gpusched: coverage: no data from 1 file(s), killed before they could save it: tests/b.py"
    ]


def test_an_attempts_folder_travels_as_plain_files(tmp_path):
    env = coverage_env(tmp_path / "run" / "3-1")
    folder = Path(env["GPUSCHED_COVERAGE_DIR"])
    assert env["COVERAGE_FILE"] == str(folder / ".coverage")
    (folder / ".coverage.host.1").write_bytes(b"data")
    (folder / ".coverage.host.1-journal").write_bytes(b"journal")
    (folder / "gpusched-coverage.json").write_text(json.dumps({"file": "t.py"}))
    packed = pack(folder)
    assert sorted(packed) == [".coverage.host.1", "gpusched-coverage.json"]
    unpack({**packed, "../escape": b"x"}, tmp_path / "driver" / "node1" / "3-1")
    assert not (tmp_path / "driver" / "node1" / "escape").exists()
    [found] = attempts(tmp_path / "driver", "*")
    assert (found.node, found.file, [p.name for p in found.files]) == (
        "node1",
        "t.py",
        [".coverage.host.1"],
    )
