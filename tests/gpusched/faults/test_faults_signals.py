"""Item 4: Ctrl-C and SIGTERM to a real ``gpusched run``, and the runner interrupted in-process."""

from __future__ import annotations

import inprocess
import pytest
import scenarios
from deadlines import hang_guard


def _reports_agree(run, interrupted: str, pending: list[str]) -> None:
    assert run.report["interrupted"] is True and run.report["exit_code"] == 2
    assert run.junit_property(interrupted, "outcome") == "INTERRUPTED"
    for name in pending:
        assert run.junit_property(name, "outcome") == "NOT RUN"
    assert run.lines(f"INTERRUPTED {interrupted}")
    for name in pending:
        assert run.lines(f"NOT RUN     {name}")
    assert run.last_line == "gpusched: 0 passed, 0 failed, 0 skipped"


@pytest.mark.timeout(hang_guard(120))
def test_sigint_then_second_sigint_kills_at_once(checked):
    observation = scenarios.sigint_twice()
    checked(observation)
    run = observation.run
    _reports_agree(run, "test_a_hang.py", ["test_b.py", "test_c.py"])
    assert run.lines("gpusched: interrupted again: killing every running file now")
    # The file ignores SIGTERM and the grace is 30 s: only the second Ctrl-C ends it early.
    assert observation.details["after_second"] < scenarios.SECOND_SIGINT_GRACE / 3
    assert run.file("test_a_hang.py")["returncode"] == -9


@pytest.mark.timeout(hang_guard(120))
def test_sigterm_interrupts_like_ctrl_c(checked):
    observation = scenarios.sigterm()
    checked(observation)
    _reports_agree(observation.run, "test_a_sleep.py", ["test_b.py"])


@pytest.mark.timeout(hang_guard(120))
def test_sigint_during_collection(checked):
    observation = scenarios.sigint_during_collection()
    checked(observation)
    assert observation.run.report["interrupted"] is True
    assert observation.run.last_line == "gpusched: 0 passed, 0 failed, 0 skipped"


@pytest.mark.timeout(hang_guard(120))
def test_runner_task_cancelled_from_outside(checked):
    observation = inprocess.cancelled()
    checked(observation)
    assert observation.details["outcomes"] == {
        "test_a_sleep.py": "INTERRUPTED",
        "test_b.py": "NOT RUN",
    }


@pytest.mark.timeout(hang_guard(120))
def test_keyboard_interrupt_in_the_runner_loop(checked):
    observation = inprocess.keyboard_interrupt()
    checked(observation)
    assert observation.details["outcomes"] == {
        "test_a_sleep.py": "INTERRUPTED",
        "test_b.py": "NOT RUN",
    }
