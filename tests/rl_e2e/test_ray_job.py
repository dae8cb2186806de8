"""The pure part of the ``ray start --head`` fixture: the status it reads."""

from __future__ import annotations

import json

import pytest

from rl_e2e.ray_job import job_status


@pytest.mark.parametrize("status", ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"])
def test_the_status_the_job_server_answers(status):
    reply = json.dumps({"type": "SUBMISSION", "submission_id": "e2e-1a2b", "status": status})
    assert job_status(reply.encode()) == status


@pytest.mark.parametrize(
    "reply",
    [
        b"Job e2e-1a2b does not exist",  # the server's 404 text
        b'{"status": "LOST"}',  # not a status of Ray's
        b'["SUCCEEDED"]',
        b"{}",
    ],
)
def test_an_answer_without_a_status_is_none(reply):
    assert job_status(reply) is None
