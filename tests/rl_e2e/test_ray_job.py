"""The pure part of the ``ray start --head`` fixture: the status it reads."""

from __future__ import annotations

import pytest

from rl_e2e.ray_job import job_status


@pytest.mark.parametrize(
    ("printed", "status"),
    [
        ("------------------------------------------\nJob 'e2e-1a2b' succeeded\n", "SUCCEEDED"),
        ("Job 'e2e-1a2b' failed\nStatus message: exit code 1", "FAILED"),
        ("Job 'e2e-1a2b' was stopped", "STOPPED"),
        ("Status for job 'e2e-1a2b': RUNNING", "RUNNING"),
        ("Status for job 'e2e-1a2b': PENDING", "PENDING"),
        ("Traceback (most recent call last): ConnectionError", None),
    ],
)
def test_the_status_ray_job_status_prints(printed, status):
    assert job_status(printed) == status
