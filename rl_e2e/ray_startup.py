"""Give a new local Ray node the time a busy machine needs to register, and start it again
when even that was missed.

``ray.init`` of a new local cluster (and ``ray start``) waits a fixed 30 s for
the new node's raylet to register with the GCS, then raises "The current node
timed out during startup" (Ray 2.60: ``ray._private.node.Node``, not
configurable). On a machine whose cores are all busy the first request to a
new GCS alone has taken 39 s, and the processes that attempt started are left
running with nobody to stop them. :func:`patient_node_start` lets the node
register for longer (``RL_E2E_NODE_START_WAIT`` seconds, default 120);
:func:`init_local` uses it, and where even that is missed stops every process
the attempt started and starts again, a bounded number of times.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from rl_e2e.reaper import kill_and_wait

__all__ = [
    "ATTEMPTS",
    "NODE_START_TIMEOUT",
    "WAIT_VARIABLE",
    "init_local",
    "is_node_start_timeout",
    "node_start_wait",
    "patient_node_start",
]

NODE_START_TIMEOUT = "The current node timed out during startup"
ATTEMPTS = 3
# Seconds a new node may take to register with its GCS (Ray's own: 30).
WAIT_VARIABLE = "RL_E2E_NODE_START_WAIT"
DEFAULT_WAIT_S = 120.0
_POLL_S = 0.5

_lock = threading.Lock()

T = TypeVar("T")

_log = logging.getLogger(__name__)


def is_node_start_timeout(error: BaseException) -> bool:
    """Whether ``error`` is Ray's missed start-up deadline of a new node (nothing else is retried)."""
    return NODE_START_TIMEOUT in str(error)


def node_start_wait(environ: dict[str, str] | None = None) -> float:
    """Seconds a new node may take to register: ``RL_E2E_NODE_START_WAIT``, else 120.

    Raises:
        ValueError: the variable is not a positive number (the message names it).
    """
    value = (os.environ if environ is None else environ).get(WAIT_VARIABLE, "")
    if not value.strip():
        return DEFAULT_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{WAIT_VARIABLE}={value!r}: expected a positive number of seconds")
    return seconds


@contextmanager
def patient_node_start(wait_s: float | None = None) -> Iterator[None]:
    """While inside, a node this process starts has ``wait_s`` seconds (default
    :func:`node_start_wait`; at least Ray's 30) to register with its GCS before Ray gives
    up on it.

    Ray's wait asks ``ray._private.services.get_node`` until the node is known and
    gives up once 30 s have passed after a failed ask; each ask here keeps asking
    until the node is known or ``wait_s`` has passed since the first. A Ray without
    that function starts its node with its own deadline.
    """
    try:
        import ray._private.services as services
    except ImportError:
        yield
        return
    original = getattr(services, "get_node", None)
    if original is None:
        yield
        return
    wait = node_start_wait() if wait_s is None else wait_s
    first: float | None = None

    def get_node(*args: Any, **kwargs: Any) -> Any:
        nonlocal first
        first = time.monotonic() if first is None else first
        while True:
            try:
                return original(*args, **kwargs)
            except RuntimeError:  # not registered yet (Ray's own loop catches the same)
                if time.monotonic() - first >= wait:
                    raise
                time.sleep(_POLL_S)

    with _lock:
        services.get_node = get_node
        try:
            yield
        finally:
            services.get_node = original


def init_local(
    init: Callable[[], T],
    stop_attempt: Callable[[], None] | None = None,
    attempts: int = ATTEMPTS,
    wait_s: float | None = None,
) -> T:
    """``init()`` (a ``ray.init`` that starts a new local node) with ``wait_s`` seconds
    (default :func:`node_start_wait`) for the node to register, again after that
    deadline was missed, ``attempts`` times at most.

    Before each new attempt ``stop_attempt`` (default: kill every process this
    process started during the failed one, and what they started) clears what
    the failed one left. Any other error, and the last attempt's, is raised as it is.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    wait = node_start_wait() if wait_s is None else wait_s
    for attempt in range(1, attempts + 1):
        before = _descendants()
        try:
            with patient_node_start(wait):
                return init()
        except Exception as error:
            if not is_node_start_timeout(error) or attempt == attempts:
                raise  # the last attempt's error is the caller's
            _log.warning(
                "Ray's node did not register within %.0f s (attempt %d of %d, a busy machine?):"
                " starting it again",
                max(wait, 30.0),
                attempt,
                attempts,
            )
            if stop_attempt is not None:
                stop_attempt()
            else:
                kill_and_wait([proc for proc in _descendants() if proc not in before])
    raise AssertionError("unreachable: the last attempt returns or raises")


def _descendants() -> set[Any]:
    """This process's descendants now (psutil processes compare by pid and creation time)."""
    import psutil

    return set(psutil.Process().children(recursive=True))
