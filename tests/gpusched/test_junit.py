"""The merged JUnit XML: one testsuite per file, per-test cases, cards as properties,
timeouts and crashes as errors with their message; read back with junitparser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

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
    # a record without the child's JUnit data: the exception line, as pytest's message is
    assert failure.message == "assert 1 == 2" and "test_fail.py:3: AssertionError" in failure.text
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


PARITY_SUITE = {
    "pytest.ini": "[pytest]\njunit_logging = all\n",
    "tests/unit/test_names.py": """
        import pytest

        @pytest.mark.parametrize("spec", ["ignore::DeprecationWarning", "a/b.c[d]", "x::y::z"])
        def test_filter(spec):
            assert spec != "x::y::z"

        class TestOuter:
            def test_m(self):
                pass

            class TestInner:
                @pytest.mark.parametrize("v", [1.5, "p.q"])
                def test_n(self, v):
                    pass
    """,
    "test_outcomes.py": """
        import logging, sys
        import pytest

        @pytest.fixture
        def broken_setup():
            raise RuntimeError("setup boom")

        @pytest.fixture
        def broken_teardown():
            yield
            raise ValueError("teardown boom")

        def test_assert():
            assert 1 == 2

        def test_raises():
            raise ValueError("line1\\nline2")

        def test_setup_error(broken_setup):
            pass

        def test_teardown_error(broken_teardown):
            pass

        def test_fails_then_teardown_error(broken_teardown):
            assert 0, "call failed"

        def test_skip():
            pytest.skip("no network")

        @pytest.mark.skip(reason="marked")
        def test_skip_marker():
            pass

        @pytest.mark.xfail(reason="known bug")
        def test_xfail():
            assert 0

        @pytest.mark.xfail
        def test_xfail_without_reason():
            raise KeyError

        @pytest.mark.xfail(reason="maybe")
        def test_xpass():
            pass

        @pytest.mark.xfail(reason="strict", strict=True)
        def test_xpass_strict():
            pass

        def test_output(record_property):
            record_property("gpu_memory", 123)
            print("to stdout")
            print("to stderr", file=sys.stderr)
            logging.getLogger("t").warning("a warning")

        def test_output_fails():
            print("before the failure")
            assert [1, 2] == [1, 3]
    """,
}


def junit_cases(text: bytes) -> list[tuple]:
    """Every testcase as (classname, name, properties, children) with what varies between
    two runs of the same test (object addresses) taken out; sorted (the files' order differs)."""
    cases = []
    for case in ET.fromstring(text).iter("testcase"):
        props = [tuple(p.attrib.items()) for p in case.iter("property")]
        children = [
            (
                child.tag,
                tuple(child.attrib.items()),
                re.sub(r"0x[0-9a-f]+", "0x?", child.text or ""),
            )
            for child in case
            if child.tag != "properties"
        ]
        cases.append((case.get("classname"), case.get("name"), props, children))
    return sorted(cases, key=repr)


def test_merged_junit_writes_what_plain_pytest_junit_writes(make_suite, run_pytest, run_gpusched):
    """Classnames and names (ids with ``::``, ``/``, ``.``, ``[``, classes, nested classes, a
    sub-directory), the message and text of failures, errors, skips and xfails, captured
    output per the ini's ``junit_logging`` and ``record_property``: all as pytest writes them."""
    tmp_path = make_suite(PARITY_SUITE)
    plain = run_pytest("--junitxml", "plain.xml")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    done = run_gpusched("run", ".", "--junitxml", "merged.xml")
    assert done.returncode == 1, done.stdout + done.stderr
    expected = junit_cases((tmp_path / "plain.xml").read_bytes())
    got = junit_cases((tmp_path / "merged.xml").read_bytes())
    assert len(expected) == 20  # 19 tests; a failed call and then a failed teardown write two
    assert got == expected
    names = {(classname, name) for classname, name, *_ in got}
    assert ("tests.unit.test_names", "test_filter[ignore::DeprecationWarning]") in names
    assert ("tests.unit.test_names.TestOuter.TestInner", "test_n[p.q]") in names
    messages = {name: children[0][1] for _, name, _, children in got if children}
    assert messages["test_assert"] == (("message", "assert 1 == 2"),)
    assert messages["test_setup_error"] == (
        ("message", 'failed on setup with "RuntimeError: setup boom"'),
    )
    assert messages["test_xfail"] == (("type", "pytest.xfail"), ("message", "known bug"))
    # The last line counts as pytest's JUnit does; the breakdown names xfailed and xpassed.
    assert done.stdout.splitlines()[-2:] == [
        "gpusched: tests: 6 passed, 1 xpassed, 5 failed, 3 error, 0 timeout, 0 crashed, "
        "2 skipped, 2 xfailed",
        "gpusched: 7 passed, 8 failed, 4 skipped",
    ]


SECTIONS_SUITE = {
    "conftest.py": """
        import pytest

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_makereport(item, call):
            report = yield
            if report.when == "call" and report.failed:
                report.sections.append(("rank 0 stderr", f"RANK0-OF-{item.name}\\n"))
            return report

        @pytest.fixture
        def ray_logs(request):
            request.node.add_report_section("call", "ray worker logs", "RAY-WORKER-LINE\\n")
    """,
    "test_dist.py": """
        def test_first_fails(ray_logs):
            assert 0, "first"

        def test_passes(ray_logs):
            pass

        def test_fails_with_a_long_output():
            for i in range(80):
                print(f"progress line {i}")
            assert 0, "second"
    """,
}


def test_report_sections_reach_the_console_and_the_junit_of_failing_tests(make_suite, run_gpusched):
    """Sections a plugin appends to a failed report (per-rank logs) and sections added with
    ``item.add_report_section`` are shown under the failure and written to ``system-err``."""
    tmp_path = make_suite(SECTIONS_SUITE)
    done = run_gpusched("run", ".", "--junitxml", "merged.xml")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    # The first failure's sections, even with a long failure after it in the same file.
    assert " rank 0 stderr ".center(80, "-") in out and "RANK0-OF-test_first_fails" in out
    assert "Captured ray worker logs call" in out and "RAY-WORKER-LINE" in out
    assert "RANK0-OF-test_fails_with_a_long_output" in out and "progress line 79" in out
    cases = {case.get("name"): case for case in ET.parse(tmp_path / "merged.xml").iter("testcase")}
    (err,) = cases["test_first_fails"].findall("system-err")
    assert "RANK0-OF-test_first_fails" in err.text and "RAY-WORKER-LINE" in err.text
    assert (
        cases["test_first_fails"].find("failure").get("message").startswith("AssertionError: first")
    )
    assert cases["test_passes"].findall("system-err") == []  # junit_logging = no: pytest's default
    assert cases["test_fails_with_a_long_output"].findall("system-out") == []
