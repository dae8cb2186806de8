"""Items 5 and 6: a collection that hangs, and the --heartbeat status lines."""

from __future__ import annotations

import pytest
import scenarios
from deadlines import hang_guard


@pytest.mark.timeout(hang_guard(90))
def test_collection_timeout_is_clear_and_leaves_nothing(checked):
    observation = scenarios.collection_timeout()
    checked(observation)
    assert "a conftest or test module probably hangs at import" in observation.run.out
    assert observation.run.seconds < 150  # bounded by --collect-timeout 2, not the 300 s hang


@pytest.mark.timeout(hang_guard(90))
def test_heartbeat_one_line_per_interval(checked):
    observation = scenarios.heartbeat()
    checked(observation)
    lines = observation.details["lines"]
    run = observation.run
    # The long file runs 3 s (plus pytest start-up) with a line every 0.5 s.
    assert 5 <= len(lines) <= 2 * run.seconds / scenarios.HEARTBEAT + 1
    out = run.out.splitlines()
    finished = out.index(next(line for line in out if line.startswith("PASSED      test_long.py")))
    assert not [line for line in out[finished:] if line.startswith("gpusched: running ")]


def test_heartbeat_problems_spots_duplicates_and_stalls():
    good = ["gpusched: running 1: a.py 0.5s", "gpusched: running 1: a.py 1.0s"]
    assert scenarios.heartbeat_problems(good, 0.5) == []
    assert scenarios.heartbeat_problems(good + good[-1:], 0.5) == [
        "duplicated lines",
        "a.py: 1.0s then 1.0s",
    ]
