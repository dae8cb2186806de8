"""Ray's missed start-up deadline is met by starting again: the loop alone, then a real cluster."""

from __future__ import annotations

import time

import psutil
import pytest

from rl_e2e.ray_startup import (
    NODE_START_TIMEOUT,
    WAIT_VARIABLE,
    init_local,
    is_node_start_timeout,
    node_start_wait,
    patient_node_start,
)

TIMEOUT = Exception(f"{NODE_START_TIMEOUT}. This could happen because some of the raylet failed")


def _flaky(failures: list[BaseException], result: str = "up"):
    calls = []

    def init():
        calls.append(len(calls))
        if failures:
            raise failures.pop(0)
        return result

    return init, calls


def test_a_missed_deadline_is_started_again_and_the_attempt_stopped_first():
    init, calls = _flaky([TIMEOUT, TIMEOUT])
    stopped = []
    assert init_local(init, lambda: stopped.append(len(calls))) == "up"
    assert calls == [0, 1, 2]
    assert stopped == [1, 2]  # after each failed attempt, before the next


def test_any_other_error_is_raised_at_once():
    init, calls = _flaky([RuntimeError("Ray is already initialised")])
    with pytest.raises(RuntimeError, match="already initialised"):
        init_local(init, lambda: None)
    assert calls == [0]
    assert not is_node_start_timeout(RuntimeError("GCS address mismatch"))


def test_the_last_attempts_error_is_raised_as_it_is():
    init, calls = _flaky([TIMEOUT, TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match=NODE_START_TIMEOUT):
        init_local(init, lambda: None, attempts=3)
    assert calls == [0, 1, 2]


def test_attempts_below_one_are_refused_naming_them():
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        init_local(lambda: "up", attempts=0)


def test_a_real_cluster_whose_first_node_missed_its_deadline_starts_again_and_leaves_nothing(
    monkeypatch,
):
    """The first node's processes really start (GCS, raylet, ...) and then Ray gives up on it,
    as when its raylet registers too late: they are killed, and the second start works."""
    import ray
    import ray._private.node as ray_node

    from rl_e2e.ray_local import local_cluster

    real_init = ray_node.Node.__init__
    first: list[psutil.Process] = []

    def late_first_node(self, *args, **kwargs):
        before = set(psutil.Process().children(recursive=True))
        real_init(self, *args, **kwargs)
        if not first:
            first.extend(set(psutil.Process().children(recursive=True)) - before)
            raise Exception(f"{NODE_START_TIMEOUT}. (injected after the node started)")

    monkeypatch.setattr(ray_node.Node, "__init__", late_first_node)
    with local_cluster({}, num_cpus=1):
        assert ray.get(ray.remote(lambda: 42).remote()) == 42
        assert first, "the first node started no process"
        alive = [proc for proc in first if proc.is_running() and proc.status() != "zombie"]
        assert alive == [], [proc.cmdline() for proc in alive]


def test_the_wait_for_a_node_is_read_from_its_variable_and_bad_values_name_it():
    assert node_start_wait({}) == 120.0
    assert node_start_wait({WAIT_VARIABLE: "45"}) == 45.0
    for bad in ("soon", "0", "-3", "nan"):
        with pytest.raises(ValueError, match=f"{WAIT_VARIABLE}='{bad}': expected a positive"):
            node_start_wait({WAIT_VARIABLE: bad})


def test_a_node_asked_for_before_it_registered_is_asked_again_until_the_wait_ends(monkeypatch):
    import ray._private.services as services

    asks = []

    def registers_on_the_third_ask(gcs_address, node_id):
        asks.append(node_id)
        if len(asks) < 3:
            raise RuntimeError("node not found")
        return {"node_id": node_id}

    monkeypatch.setattr(services, "get_node", registers_on_the_third_ask)
    monkeypatch.setattr("rl_e2e.ray_startup._POLL_S", 0.01)
    with patient_node_start(60):
        assert services.get_node("gcs", "n1") == {"node_id": "n1"}
    assert asks == ["n1"] * 3
    assert services.get_node is registers_on_the_third_ask  # put back

    asks.clear()
    monkeypatch.setattr(services, "get_node", lambda *_: asks.append(1) or _raise())
    with patient_node_start(0.2), pytest.raises(RuntimeError, match="never"):
        services.get_node("gcs", "n2")
    assert len(asks) > 2  # asked until the 0.2 s ended, then Ray's own error


def _raise():
    raise RuntimeError("never registers")


class _FastClock:
    """``time`` for Ray's node module, its monotonic clock 20x fast: Ray's fixed 30 s wait
    for a node to register ends after 1.5 s."""

    def __init__(self):
        self._start = time.monotonic()

    def monotonic(self):
        return self._start + 20 * (time.monotonic() - self._start)

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_real_node_that_registers_after_rays_own_deadline_is_waited_for(monkeypatch):
    """The node's GCS answers "not registered" for 3 s, twice Ray's (sped-up) deadline:
    the cluster still starts on its first attempt."""
    import ray
    import ray._private.node as ray_node
    import ray._private.services as services

    from rl_e2e.ray_local import local_cluster

    real_get_node = services.get_node
    first_ask: list[float] = []
    starts = []
    real_init = ray_node.Node.__init__

    def late(gcs_address, node_id):
        if not first_ask:
            first_ask.append(time.monotonic())
        if time.monotonic() - first_ask[0] < 3.0:
            raise RuntimeError("node not registered yet (injected)")
        return real_get_node(gcs_address, node_id)

    def counted_init(self, *args, **kwargs):
        starts.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ray_node, "time", _FastClock())
    monkeypatch.setattr(services, "get_node", late)
    monkeypatch.setattr(ray_node.Node, "__init__", counted_init)
    with local_cluster({}, num_cpus=1):
        assert ray.get(ray.remote(lambda: 42).remote()) == 42
    assert len(starts) == 1, "the node was started again: Ray's own deadline ended the wait"
    assert time.monotonic() - first_ask[0] >= 3.0
