"""``rl_e2e.ray_local.local_cluster``: the local Ray cluster behind the ``e2e_ray`` fixtures."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import ray

from rl_e2e.ray_local import local_cluster, with_lazy_workers


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


def _raylet_workers() -> list[psutil.Process]:
    """Python workers the raylet of this process's cluster has started."""
    raylets = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    return [
        child
        for raylet in raylets
        for child in raylet.children()
        if "default_worker" in " ".join(child.cmdline()) or child.cmdline()[:1] == ["ray::IDLE"]
    ]


def test_no_idle_worker_is_started_ahead_of_the_tests_own():
    """Ray's prestart of idle workers for the first driver is off: they would serve no actor."""
    with local_cluster({}, num_cpus=2):
        time.sleep(3)  # Ray's prestarted workers are up well within this on the 2-core machine
        assert _raylet_workers() == []
        assert isinstance(ray.get(niceness.remote()), int)  # a task gets workers on demand
        assert _raylet_workers()  # (so the test sees the workers the raylet starts)


def test_the_callers_system_config_is_kept_and_may_turn_the_prestart_back_on():
    assert with_lazy_workers({"num_gpus": 0}) == {
        "num_gpus": 0,
        "_system_config": {"prestart_worker_first_driver": False},
    }
    given = {
        "_system_config": {"prestart_worker_first_driver": True, "object_timeout_milliseconds": 5}
    }
    assert with_lazy_workers(given) == given
