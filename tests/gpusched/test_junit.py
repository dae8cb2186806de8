"""The merged JUnit XML: one testsuite per file, per-test cases, cards as properties,
timeouts and crashes as errors with their message; read back with junitparser."""

from __future__ import annotations

import json
import subprocess
import sys

import junitparser
from deadlines import hang_guard
from junitparser import Error, Failure, JUnitXml, Skipped

from gpusched.collection.collect import CollectError, Collection
from gpusched.reporting.report import junit_xml
from gpusched.results import judge
from gpusched.session import collection_results


def events(*records: dict) -> list[str]:
    return [json.dumps(record) for record in records]


def start(nodeid: str) -> dict:
    return {"event": "start", "nodeid": nodeid}


def result(nodeid: str, outcome: str, message: str = "") -> dict:
    return {"event": "result", "nodeid": nodeid, "outcome": outcome, "duration": 0.25,
            "message": message}  # fmt: skip


def suites_by_name(text: bytes) -> dict[str, junitparser.TestSuite]:
    xml = JUnitXml.fromstring(text)
    return {suite.name: suite for suite in xml}


def properties(suite: junitparser.TestSuite) -> dict[str, str]:
    return {prop.name: prop.value for prop in suite.properties()}


def cases(suite: junitparser.TestSuite) -> dict[str, junitparser.TestCase]:
    return {case.name: case for case in suite}


def test_timeouts_crashes_failures_and_collection_errors_in_one_report(tmp_path):
    timed_out = judge(
        "/r/test_slow.py",
        ["test_slow.py::test_a", "test_slow.py::test_b", "test_slow.py::test_c"],
        -9,
        events(start("test_slow.py::test_a"), result("test_slow.py::test_a", "passed"),
               start("test_slow.py::test_b")),
        timed_out=30.0,
    )  # fmt: skip
    timed_out.cards, timed_out.start, timed_out.end = ("0", "1"), 1.0, 31.0
    crashed = judge(
        "/r/test_crash.py",
        ["test_crash.py::test_x"],
        -6,
        events(start("test_crash.py::test_x")),
    )
    crashed.cards, crashed.end = ("2",), 2.0
    failed = judge(
        "/r/test_fail.py",
        ["test_fail.py::test_f", "test_fail.py::test_s"],
        1,
        events(
            result("test_fail.py::test_f", "failed", "E   assert 1 == 2\ntest_fail.py:3: AssertionError"),
            result("test_fail.py::test_s", "skipped", "no network"),
            {"event": "finish", "exitstatus": 1},
        ),
    )  # fmt: skip
    failed.end = 0.5
    broken = collection_results(
        Collection(
            "/r", errors=[CollectError("/r/test_broken.py", "test_broken.py", "ImportError: x")]
        )
    )
    text = junit_xml([timed_out, crashed, failed, *broken])
    suites = suites_by_name(text.encode("utf-8"))  # as bytes: lxml refuses a declared str
    assert len(suites) == 4

    slow = suites[next(name for name in suites if name.endswith("test_slow.py"))]
    assert properties(slow)["cards"] == "0,1" and properties(slow)["outcome"] == "TIMEOUT"
    assert (slow.tests, slow.errors, slow.failures, slow.skipped) == (3, 1, 0, 1)
    assert float(slow.time) == 30.0
    slow_cases = cases(slow)
    assert slow_cases["test_a"].is_passed
    (error,) = slow_cases["test_b"].result
    assert isinstance(error, Error) and error.type == "timeout"
    assert error.message == "timeout: timed out after 30s in test_slow.py::test_b"
    assert isinstance(slow_cases["test_c"].result[0], Skipped)  # never reached: not run

    crash = suites[next(name for name in suites if name.endswith("test_crash.py"))]
    (error,) = cases(crash)["test_x"].result
    assert isinstance(error, Error) and error.type == "crashed"
    assert "killed by SIGABRT during test_crash.py::test_x" in error.message
    assert properties(crash)["cards"] == "2"

    fail = suites[next(name for name in suites if name.endswith("test_fail.py"))]
    (failure,) = cases(fail)["test_f"].result
    assert isinstance(failure, Failure)
    assert failure.message == "test_fail.py:3: AssertionError" and "assert 1 == 2" in failure.text
    assert cases(fail)["test_s"].result[0].message == "no network"
    assert properties(fail)["cards"] == ""  # a CPU file

    broken_suite = suites[next(name for name in suites if name.endswith("test_broken.py"))]
    (error,) = next(iter(broken_suite)).result
    assert isinstance(error, Error) and "ImportError: x" in error.text
    assert properties(broken_suite)["outcome"] == "ERROR"

    root = JUnitXml.fromstring(text.encode("utf-8"))
    assert (root.tests, root.failures, root.errors) == (7, 1, 3)


SUITE = {
    "test_ok.py": "import pytest\npytestmark = pytest.mark.gpu(2)\n"
    "def test_one():\n    pass\ndef test_two():\n    pass\n",
    "test_bad.py": "def test_fails():\n    assert 1 + 1 == 3\n",
    "test_hang.py": "import time, pytest\npytestmark = pytest.mark.gpu(1)\n"
    "def test_done():\n    pass\ndef test_hangs():\n    time.sleep(120)\n",
    "test_abort.py": "import os\ndef test_first():\n    pass\ndef test_dies():\n    os.abort()\n",
}


def test_gpusched_run_writes_a_junit_file_junitparser_reads(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "gpusched", "run", ".", "--simulate-gpus", "2", "--timeout", "8",
         "--kill-grace", "1", "--junitxml", "reports/junit.xml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(180),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "\x1b" not in done.stdout + done.stderr  # a pipe: plain lines, no control codes
    suites = suites_by_name((tmp_path / "reports" / "junit.xml").read_bytes())
    assert sorted(suites) == sorted(SUITE)
    assert properties(suites["test_ok.py"])["cards"] == "0,1"
    assert all(case.is_passed for case in suites["test_ok.py"])
    hang = cases(suites["test_hang.py"])
    assert properties(suites["test_hang.py"])["outcome"] == "TIMEOUT"
    assert hang["test_done"].is_passed
    assert hang["test_hangs"].result[0].message.startswith("timeout: timed out after 8s")
    abort = cases(suites["test_abort.py"])
    assert abort["test_first"].is_passed
    assert "killed by SIGABRT" in abort["test_dies"].result[0].message
    assert isinstance(cases(suites["test_bad.py"])["test_fails"].result[0], Failure)
    assert done.stdout.splitlines()[-1] == "gpusched: 4 passed, 3 failed, 0 skipped"
