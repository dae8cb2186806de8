"""Start a local Ray node again when Ray's own start-up deadline was missed.

``ray.init`` of a new local cluster (and ``ray start``) waits a fixed 30 s for
the new node's raylet to register with the GCS, then raises "The current node
timed out during startup" (Ray 2.60: ``ray._private.node.Node``, not
configurable). On a machine whose cores are all busy a raylet can take longer,
and the processes that attempt started are left running with nobody to stop
them. :func:`init_local` stops them (every process this one started during the
attempt) and starts again, a bounded number of times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from rl_e2e.reaper import kill_and_wait

__all__ = ["ATTEMPTS", "NODE_START_TIMEOUT", "init_local", "is_node_start_timeout"]

NODE_START_TIMEOUT = "The current node timed out during startup"
ATTEMPTS = 3

T = TypeVar("T")

_log = logging.getLogger(__name__)


def is_node_start_timeout(error: BaseException) -> bool:
    """Whether ``error`` is Ray's missed start-up deadline of a new node (nothing else is retried)."""
    return NODE_START_TIMEOUT in str(error)


def init_local(
    init: Callable[[], T],
    stop_attempt: Callable[[], None] | None = None,
    attempts: int = ATTEMPTS,
) -> T:
    """``init()`` (a ``ray.init`` that starts a new local node), again after Ray's start-up
    deadline was missed, ``attempts`` times at most.

    Before each new attempt ``stop_attempt`` (default: kill every process this
    process started during the failed one, and what they started) clears what
    the failed one left. Any other error, and the last attempt's, is raised as it is.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts):
        before = _descendants()
        try:
            return init()
        except Exception as error:
            if not is_node_start_timeout(error):
                raise
            _log.warning(
                "Ray's node did not register within its start-up deadline (attempt %d of %d,"
                " a busy machine?): starting it again",
                attempt,
                attempts,
            )
            if stop_attempt is not None:
                stop_attempt()
            else:
                kill_and_wait([proc for proc in _descendants() if proc not in before])
    return init()  # the last attempt: its error is the caller's


def _descendants() -> set[Any]:
    """This process's descendants now (psutil processes compare by pid and creation time)."""
    import psutil

    return set(psutil.Process().children(recursive=True))
