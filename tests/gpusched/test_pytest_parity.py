"""gpusched's reports say what pytest's say: JUnit names, messages, captured output and
report sections, and the counts of the last line. Pure rules, no processes."""

from __future__ import annotations

import pytest

from gpusched.reporting.junit import (
    JunitCases,
    Phase,
    fallback_case,
    junit_names,
    shown_sections,
    xml_safe,
)
from gpusched.reporting.report import breakdown_line, buckets, failure_lines, summary_lines
from gpusched.results import FileResult, JunitCase, JunitElement, Outcome, PhaseReport
from gpusched.results import TestResult as Result

NODEIDS = {
    "test_a.py::test_f": ("test_a", "test_f"),
    "sub/deep/test_b.py::TestK::TestInner::test_n[1]": (
        "sub.deep.test_b.TestK.TestInner",
        "test_n[1]",
    ),
    "testing/test_config.py::test_parse_warning_filter[ignore::DeprecationWarning-expected0]": (
        "testing.test_config",
        "test_parse_warning_filter[ignore::DeprecationWarning-expected0]",
    ),
    "t.py::TestK::test_p[a/b.c[d]]": ("t.TestK", "test_p[a/b.c[d]]"),
    "t.py::test_p[x::y::z]": ("t", "test_p[x::y::z]"),
    "a.b/test_c.py::test_d[1.5-x.y]": ("a.b.test_c", "test_d[1.5-x.y]"),
    "pkg/test_broken.py": ("", "pkg.test_broken"),  # a collection error: the file's own id
}


@pytest.mark.parametrize("nodeid", NODEIDS)
def test_junit_names_are_pytests(nodeid):
    assert junit_names(nodeid) == NODEIDS[nodeid]
    mangle = getattr(pytest.importorskip("_pytest.junitxml"), "mangle_test_address", None)
    if mangle is not None:  # the rule of the pytest installed here, for the same ids
        names = mangle(nodeid)
        assert junit_names(nodeid) == (".".join(names[:-1]), names[-1])


def test_junitprefix_goes_before_the_classname():
    assert junit_names("t.py::TestK::test_m", "ci") == ("ci.t.TestK", "test_m")
    assert junit_names("t.py", "ci") == ("ci", "t")


def test_characters_xml_cannot_hold_are_written_visibly():
    assert xml_safe("red \x1b[31mE\x1b[0m ok\ttab é") == "red #x1B[31mE#x1B[0m ok\ttab é"


def elements(cases):
    return [[(e.tag, e.attrs, e.text) for e in case.elements] for case in cases.cases]


def run(*phases: Phase, **settings) -> JunitCases:
    cases = JunitCases(**settings)
    for phase in phases:
        cases.add(phase)
    return cases


SETUP = Phase("setup", "passed", 0.25)
TEARDOWN = Phase("teardown", "passed", 0.25)
FAILED_CALL = Phase(
    "call", "failed", 0.5, crash="assert 1 == 2", text="E   assert 1 == 2\nt.py:3: AssertionError"
)


def test_a_failure_has_the_exception_message_and_the_whole_report_as_text():
    cases = run(SETUP, FAILED_CALL, TEARDOWN)
    assert elements(cases) == [
        [("failure", {"message": "assert 1 == 2"}, "E   assert 1 == 2\nt.py:3: AssertionError")]
    ]
    assert cases.cases[0].time == 1.0
    shortened = run(SETUP, FAILED_CALL, TEARDOWN, shorten=lambda m: m[:6]).cases[0]
    assert shortened.elements[0].attrs["message"] == "assert"  # pytest's shorten_message


def test_setup_and_teardown_errors_say_where_they_failed():
    setup = Phase("setup", "failed", crash="RuntimeError: boom", text="tb")
    assert elements(run(setup, TEARDOWN)) == [
        [("error", {"message": 'failed on setup with "RuntimeError: boom"'}, "tb")]
    ]
    teardown = Phase("teardown", "failed", crash="ValueError: late", text="tb2")
    passed = Phase("call", "passed")
    assert elements(run(SETUP, passed, teardown)) == [
        [("error", {"message": 'failed on teardown with "ValueError: late"'}, "tb2")]
    ]
    # A failed call, then a failed teardown: pytest writes two testcases for the one test.
    two = run(SETUP, FAILED_CALL, teardown)
    assert [len(case.elements) for case in two.cases] == [1, 1]
    assert [case.elements[0].tag for case in two.cases] == ["failure", "error"]
    no_crash = Phase("setup", "failed", text="plain text repr")
    assert elements(run(no_crash, TEARDOWN))[0][0][1] == {
        "message": 'failed on setup with "plain text repr"'
    }


def test_skips_and_xfails_carry_their_reason_and_xpass_passes():
    skip = Phase("call", "skipped", skip=("/r/t.py", 4, "Skipped: no network"))
    assert elements(run(SETUP, skip, TEARDOWN)) == [
        [("skipped", {"type": "pytest.skip", "message": "no network"}, "/r/t.py:4: no network")]
    ]
    xfail = Phase("call", "skipped", wasxfail="reason: known bug")
    assert elements(run(SETUP, xfail, TEARDOWN)) == [
        [("skipped", {"type": "pytest.xfail", "message": "known bug"}, None)]
    ]
    xpass = Phase("call", "passed", wasxfail="maybe")
    assert elements(run(SETUP, xpass, TEARDOWN)) == [[]]


@pytest.mark.parametrize(
    ("logging", "expected"),
    [
        ("no", []),
        ("system-out", [("system-out", "Captured Out", "OUT")]),
        ("system-err", [("system-err", "Captured Err", "ERR")]),
        ("log", [("system-out", "Captured Log", "LOG")]),
        ("out-err", [("system-out", "Captured Out", "OUT"), ("system-err", "Captured Err", "ERR")]),
    ],
)
def test_captured_output_goes_where_junit_logging_says(logging, expected):
    teardown = Phase("teardown", "passed", stdout="OUT\n", stderr="ERR\n", log="LOG\n")
    (case,) = run(SETUP, Phase("call", "passed"), teardown, logging=logging).cases
    assert [
        (e.tag, e.text.splitlines()[0].strip("- "), e.text.splitlines()[1]) for e in case.elements
    ] == expected
    quiet = run(SETUP, Phase("call", "passed"), teardown, logging=logging, log_passing_tests=False)
    assert quiet.cases[0].elements == []  # junit_log_passing_tests = false


def test_sections_pytest_drops_reach_system_err_of_a_failing_test_only():
    sections = [
        ("Captured stdout call", "out\n"),
        ("rank 0 stderr", "NCCL timeout on rank 0\n"),
        ("Captured ray worker logs call", "worker died\n"),
    ]
    failed = Phase("call", "failed", crash="boom", text="tb", sections=sections)
    (case,) = run(SETUP, failed, TEARDOWN).cases  # junit_logging = no: pytest writes no output
    assert [e.tag for e in case.elements] == ["failure", "system-err"]
    text = case.elements[1].text
    assert " rank 0 stderr ".center(80, "-") in text and "NCCL timeout on rank 0" in text
    assert "Captured ray worker logs call" in text and "worker died" in text
    assert "out" not in text.replace("timeout", "")  # captured stdout follows junit_logging
    # With junit_logging asking for stderr, the sections follow pytest's own Captured Err.
    teardown = Phase("teardown", "passed", stderr="ERR\n")
    (case,) = run(SETUP, failed, teardown, logging="system-err").cases
    (err,) = [e for e in case.elements if e.tag == "system-err"]
    assert err.text.index("Captured Err") < err.text.index("rank 0 stderr")
    passed = Phase("call", "passed", sections=sections)
    assert run(SETUP, passed, TEARDOWN).cases[0].elements == []


def test_record_property_values_are_the_testcases_properties():
    teardown = Phase("teardown", "passed", properties=[("gpu_memory", "123")])
    (case,) = run(SETUP, Phase("call", "passed"), teardown).cases
    assert case.properties == [("gpu_memory", "123")]


def test_results_the_child_did_not_describe():
    collect = fallback_case("pkg/test_broken.py", "error", "SyntaxError: x", 0.0)
    assert [(e.tag, e.attrs) for e in collect.elements] == [
        ("error", {"message": "collection failure"})
    ]
    skipped = fallback_case("test_gpu.py", "skipped", "Skipped: no CUDA", 0.0)
    assert skipped.elements[0].attrs == {"message": "collection skipped"}
    timeout = fallback_case("t.py::test_x", "timeout", "timed out after 8s in t.py::test_x", 8.0)
    assert timeout.elements[0].attrs == {
        "message": "timeout: timed out after 8s in t.py::test_x",
        "type": "timeout",
    }
    failed = fallback_case("t.py::test_x", "failed", "def f():\nE   assert 1 == 2\nt.py:3: Err", 0)
    assert failed.elements[0].attrs == {"message": "assert 1 == 2"}


def test_show_capture_picks_the_sections_the_console_shows():
    sections = [
        ("Captured stdout call", "o"),
        ("Captured stderr call", "e"),
        ("rank 0 stderr", "r"),
    ]
    assert shown_sections(sections) == sections
    assert shown_sections(sections, "no") == []
    assert shown_sections(sections, "stderr") == sections[1:]


def file_with(**counts: int) -> FileResult:
    result = FileResult("/r/t.py", Outcome.FAILED)
    for outcome, n in counts.items():
        result.tests += [Result(f"t.py::{outcome}{i}", outcome.replace("_", " ")) for i in range(n)]
    return result


def test_xfailed_counts_as_skipped_and_xpassed_as_passed_and_both_are_named():
    tally = file_with(passed=5, xpassed=1, failed=6, error=3, skipped=2, xfailed=12).counts()
    assert buckets(tally) == (6, 9, 14)
    assert breakdown_line(tally) == (
        "gpusched: tests: 5 passed, 1 xpassed, 6 failed, 3 error, 0 timeout, 0 crashed, "
        "2 skipped, 12 xfailed"
    )
    lines = summary_lines([file_with(passed=3, xfailed=12, xpassed=1)])
    assert lines[-2:] == [
        "gpusched: tests: 3 passed, 1 xpassed, 12 xfailed",
        "gpusched: 4 passed, 0 failed, 12 skipped",
    ]
    assert summary_lines([file_with(passed=3)])[-2:] == [
        "gpusched: files: 1 failed",
        "gpusched: 3 passed, 0 failed, 0 skipped",
    ]  # nothing to break down: the last line says it all
    assert (
        breakdown_line(file_with(passed=1, not_run=2).counts())
        == "gpusched: tests: 1 passed, 2 not run"
    )


def test_the_console_shows_each_failed_phase_with_its_sections():
    test = Result(
        "t.py::test_x",
        "error",
        reports=[
            PhaseReport(
                "call",
                "    def test_x():\n>       assert 0\nE       assert 0",
                [("rank 0 stderr", "NCCL\n")],
            ),
            PhaseReport("teardown", "tb", []),
        ],
    )
    result = FileResult("/r/t.py", Outcome.FAILED, tests=[test, Result("t.py::test_ok", "passed")])
    lines = failure_lines(result)
    assert lines[0] == " t.py::test_x ".center(80, "_")
    assert lines[1] == "    def test_x():"
    assert " rank 0 stderr ".center(80, "-") in lines and "NCCL" in lines
    assert " ERROR at teardown of t.py::test_x ".center(80, "_") in lines
    long = FileResult(
        "/r/t.py",
        Outcome.FAILED,
        tests=[
            Result(
                "t.py::t", "failed", reports=[PhaseReport("call", "\n".join(map(str, range(50))))]
            )
        ],
    )
    assert failure_lines(long, text_lines=10)[1:] == [
        "... (40 lines above not shown)",
        *map(str, range(40, 50)),
    ]


def test_junit_element_round_trips_through_the_stream():
    case = JunitCase(1.5, [JunitElement("failure", {"message": "m"}, "t")], [("k", "v")])
    assert JunitCase.from_json(case.to_json()) == case
