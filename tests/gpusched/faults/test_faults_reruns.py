"""Item 9: --reruns N reruns a failed file in a fresh process; passing on a rerun is FLAKY."""

from __future__ import annotations

import pytest
import scenarios
from deadlines import hang_guard


@pytest.mark.timeout(hang_guard(120))
def test_flaky_file_is_rerun_in_a_fresh_process(checked):
    observation = scenarios.flaky()
    checked(observation)
    run = observation.run
    pids = observation.details["pids"]
    assert len(pids) == 2 and pids[0] != pids[1]
    assert run.file("test_flaky.py")["attempts"] == 2
    assert run.junit_property("test_flaky.py", "attempts") == "2"
    assert run.junit_property("test_broken.py", "outcome") == "FAILED"
    assert run.code == 1
    assert run.last_line == "gpusched: 1 passed, 1 failed, 0 skipped"
