"""A local node without the helpers it never uses: real clusters, their processes listed."""

from __future__ import annotations

import psutil
import pytest
from deadlines import wait_until

from rl_e2e.ray_lean import LEAN_VARIABLE, lean_local_node, usage_stats_off
from rl_e2e.ray_local import local_cluster

HELPERS = {
    "autoscaler monitor": "autoscaler/_private/monitor.py",
    "log monitor": "log_monitor.py",
    "dashboard": "dashboard/dashboard.py",
}
ALWAYS = {"gcs": "gcs_server", "raylet": "/raylet", "dashboard agent": "dashboard/agent.py"}


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
    with local_cluster({}, num_cpus=1, log_to_driver=False) as cluster:
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
    from ray._private.node import Node

    original = Node.__init__, Node.start_api_server
    with lean_local_node(log_to_driver=False):
        assert Node.__init__ is not original[0]
    assert (Node.__init__, Node.start_api_server) == original
    monkeypatch.setenv(LEAN_VARIABLE, "0")
    with lean_local_node(log_to_driver=False):
        assert (Node.__init__, Node.start_api_server) == original


@pytest.mark.parametrize(("value", "off"), [("0", True), ("1", False), ("yes", False)])
def test_usage_stats_are_off_as_ray_reads_its_variable(monkeypatch, value, off):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", value)  # "yes": Ray refuses it; kept on
    assert usage_stats_off() is off
