"""Meant to FAIL (the first test): what a failing Ray test reports; leftovers are removed.

Run by name: ``python -m pytest failing``. The two last tests pass: the plugin
removes the actor a test leaves behind before the next test needs its CPUs.
"""

from __future__ import annotations

import pytest
import ray
from minirl.rollout import fan_out_scores

_left_behind: list = []  # a leak: handles kept past their test keep their actors alive


@pytest.fixture(scope="module")
def e2e_ray_host_env() -> dict[str, str]:
    """Forwarded by the MINIRL_ prefix: the scorers print what they do."""
    return {"MINIRL_LOG_LEVEL": "DEBUG"}


@ray.remote
class Hog:
    def ready(self) -> bool:
        return True


@ray.remote(num_cpus=1)
def one_cpu_task() -> str:
    return "ran"


def test_a_ray_test_fails_after_a_worker_printed(e2e_ray):
    """Fails; the report carries what the scorer printed (``Captured stderr ray worker logs``)."""
    assert fan_out_scores(["a", "bb", "ccc"], 1) == [1.0, 1.0, 1.0], "rewards are not lengths"


def test_leaves_an_actor_holding_every_cpu(e2e_ray):
    """Passes, but leaves an actor that holds all of the cluster's CPUs."""
    hog = Hog.options(num_cpus=e2e_ray.num_cpus).remote()
    assert ray.get(hog.ready.remote())
    _left_behind.append(hog)


def test_the_next_test_still_gets_a_cpu(e2e_ray):
    """Passes: the plugin removed the hog between the tests."""
    assert ray.get(one_cpu_task.remote(), timeout=120) == "ran"
