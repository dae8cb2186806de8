"""A local node without the helpers it never uses: real clusters, their processes listed."""

from __future__ import annotations

import sys

import psutil
import pytest
from deadlines import wait_until

from rl_e2e.ray_lean import (
    LEAN_VARIABLE,
    dashboard_dependency_error,
    lean_local_node,
    usage_stats_off,
)
from rl_e2e.ray_local import local_cluster

HELPERS = {
    "autoscaler monitor": "autoscaler/_private/monitor.py",
    "log monitor": "log_monitor.py",
    "dashboard": "dashboard/dashboard.py",
}
ALWAYS = {"gcs": "gcs_server", "raylet": "/raylet", "dashboard agent": "dashboard/agent.py"}


def _agent_cmdline(temp_dir) -> str:
    """The command line of the dashboard agent of the node in ``temp_dir``."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(temp_dir) in cmdline and ALWAYS["dashboard agent"] in cmdline:
            return cmdline
    raise AssertionError(f"no dashboard agent runs for {temp_dir}")


def _processes_of(temp_dir) -> set[str]:
    """Which of the helpers, and of the processes every node has, run for the node in ``temp_dir``."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(temp_dir) not in cmdline:
            continue
        found |= {name for name, part in {**HELPERS, **ALWAYS}.items() if part in cmdline}
    return found


def _square():
    """A task defined here, so that Ray pickles it by value: the workers cannot import tests."""

    def square(x: int) -> int:
        print(f"squaring {x}", flush=True)
        return x * x

    return square


def test_a_node_without_log_to_driver_runs_without_the_three_helpers(monkeypatch):
    import ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    imported_before = {"aiohttp", "pydantic"} & set(sys.modules)
    with local_cluster({}, num_cpus=1, log_to_driver=False) as cluster:
        # The dashboard's packages were found, not imported, as the node started (Ray's
        # serialization imports pydantic at the first task); the agent is the full one,
        # as Ray's own check says for this installation (ray[default]).
        assert {"aiohttp", "pydantic"} & set(sys.modules) == imported_before
        assert "--minimal" not in _agent_cmdline(cluster.temp_dir)
        assert ray.get(ray.remote(_square()).remote(3)) == 9
        assert _processes_of(cluster.temp_dir) == set(ALWAYS)


def test_with_log_to_driver_the_log_monitor_stays_and_a_workers_print_reaches_the_driver(
    monkeypatch, capfd
):
    import ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with local_cluster({}, num_cpus=1) as cluster:
        assert ray.get(ray.remote(_square()).remote(4)) == 16
        assert _processes_of(cluster.temp_dir) == {*ALWAYS, "log monitor"}
        seen = []
        wait_until(
            lambda: seen.extend(capfd.readouterr()) or "squaring 4" in "".join(seen),
            10,
            "the worker's print on the driver's output",
        )


def test_usage_stats_on_keeps_the_dashboard_process(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    with local_cluster({}, num_cpus=1, log_to_driver=False) as cluster:
        assert _processes_of(cluster.temp_dir) == {*ALWAYS, "dashboard"}


def test_switched_off_and_after_its_block_ray_s_node_is_as_it_comes(monkeypatch):
    import ray._private.utils as ray_utils
    from ray._private.node import Node

    def patched():
        return Node.__init__, Node.start_api_server, ray_utils.get_dashboard_dependency_error

    original = patched()
    with lean_local_node(log_to_driver=False):
        assert all(now is not then for now, then in zip(patched(), original, strict=True))
    assert patched() == original
    monkeypatch.setenv(LEAN_VARIABLE, "0")
    with lean_local_node(log_to_driver=False):
        assert patched() == original


def test_the_dependency_check_answers_as_ray_s_and_names_a_missing_package():
    import importlib.util

    import ray._private.utils as ray_utils

    assert ray_utils.get_dashboard_dependency_error() is None  # ray[default] is installed
    assert dashboard_dependency_error() is None

    def without_pydantic(name):
        return None if name == "pydantic" else importlib.util.find_spec(name)

    missing = dashboard_dependency_error(find_spec=without_pydantic)
    assert isinstance(missing, ImportError) and missing.name == "pydantic"


@pytest.mark.parametrize(("value", "off"), [("0", True), ("1", False), ("yes", False)])
def test_usage_stats_are_off_as_ray_reads_its_variable(monkeypatch, value, off):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", value)  # "yes": Ray refuses it; kept on
    assert usage_stats_off() is off
