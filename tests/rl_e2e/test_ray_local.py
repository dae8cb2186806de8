"""``rl_e2e.ray_local.local_cluster``: the local Ray cluster behind the ``e2e_ray`` fixtures."""

from __future__ import annotations

import os

import pytest
import ray

from rl_e2e.ray_local import local_cluster


@ray.remote(num_cpus=1)
def niceness() -> int:
    return os.nice(0)


@pytest.mark.parametrize("given", [None, "3"], ids=["unset", "set"])
def test_workers_run_at_the_tests_niceness_unless_it_is_set(monkeypatch, given):
    """At Ray's default of 15, a cluster's workers starve beside other tests' processes."""
    if given is None:
        monkeypatch.delenv("RAY_worker_niceness", raising=False)
    else:
        monkeypatch.setenv("RAY_worker_niceness", given)
    with local_cluster({}, num_cpus=1):
        seen = ray.get(niceness.remote())
    # Ray's worker adds the niceness to the one it inherited (Linux caps it at 19).
    assert seen == min(19, os.nice(0) + int(given or 0))
    assert os.environ.get("RAY_worker_niceness") == given
