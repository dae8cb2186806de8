"""Ray's missed start-up deadline is met by starting again: the loop alone, then a real cluster."""

from __future__ import annotations

import psutil
import pytest

from rl_e2e.ray_startup import NODE_START_TIMEOUT, init_local, is_node_start_timeout

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
