"""Fault-injection tests: each injection runs real processes and is bounded to seconds."""

from __future__ import annotations

import pytest
from faultkit import Observation


def check(observation: Observation) -> None:
    """The injection behaved as expected and left no process and no temporary file behind."""
    context = observation.run.out if observation.run is not None else observation.details
    assert observation.observed == observation.expected, context
    assert observation.processes_left == [], context
    assert observation.temp_left == [], context
    if observation.run is not None:  # the injections run with the fork server, the default
        assert "fork server off" not in observation.run.out, context


@pytest.fixture
def checked():
    return check
