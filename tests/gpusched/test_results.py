"""judge(): a child's exit and event stream -> the file's outcome, without processes."""

import json

from gpusched.results import Outcome, judge


def stream(*events):
    return [json.dumps(event) for event in events]


def start(nodeid):
    return {"event": "start", "nodeid": nodeid}


def result(nodeid, outcome="passed"):
    return {"event": "result", "nodeid": nodeid, "outcome": outcome, "duration": 0.1, "message": ""}


TESTS = ["t.py::a", "t.py::b", "t.py::c"]


def test_clean_pass_and_failure():
    ok = judge(
        "t.py", TESTS, 0, stream(*(result(t) for t in TESTS), {"event": "finish", "exitstatus": 0})
    )
    assert ok.outcome == Outcome.PASSED and ok.counts() == {"passed": 3}
    bad = judge(
        "t.py",
        TESTS,
        1,
        stream(
            result("t.py::a"),
            result("t.py::b", "failed"),
            result("t.py::c"),
            {"event": "finish", "exitstatus": 1},
        ),
    )
    assert bad.outcome == Outcome.FAILED and bad.counts() == {"passed": 2, "failed": 1}


def test_crash_mid_test_blames_the_running_test_and_keeps_finished_ones():
    events = stream(start("t.py::a"), result("t.py::a"), start("t.py::b"))
    crashed = judge("t.py", TESTS, -11, events + ['{"event": "res'])  # torn last line
    assert crashed.outcome == Outcome.CRASHED
    assert crashed.message == "killed by SIGSEGV during t.py::b"
    assert [(t.nodeid, t.outcome) for t in crashed.tests] == [
        ("t.py::a", "passed"),
        ("t.py::b", "crashed"),
        ("t.py::c", "not run"),
    ]


def test_os_exit_with_a_pytest_like_code_is_still_a_crash():
    crashed = judge("t.py", TESTS, 3, stream(start("t.py::a")))
    assert crashed.outcome == Outcome.CRASHED and "exited with code 3" in crashed.message


def test_timeout_and_interrupt():
    timed = judge("t.py", TESTS, -15, stream(start("t.py::a")), timed_out=2.0)
    assert timed.outcome == Outcome.TIMEOUT and timed.counts() == {"timeout": 1, "not run": 2}
    stopped = judge(
        "t.py", TESTS, -15, stream(result("t.py::a"), start("t.py::b")), interrupted=True
    )
    assert stopped.outcome == Outcome.INTERRUPTED and stopped.counts() == {
        "passed": 1,
        "not run": 2,
    }


def test_pytest_internal_error_without_tests_is_an_error():
    broken = judge("t.py", TESTS, 3, stream({"event": "finish", "exitstatus": 3}))
    assert broken.outcome == Outcome.ERROR and broken.counts() == {"error": 1}
