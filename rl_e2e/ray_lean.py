"""A local Ray node without the helper processes that a test's or one run's cluster never uses.

``ray.init(address="local")`` starts, beside the GCS, the raylet and its agents,
three Python helpers whose work a cluster that lives for one test module or one
training run never needs:

- the autoscaler monitor (``autoscaler/_private/monitor.py``): it scales a
  cluster that has no provider to scale, and reports demand to ``ray status``;
- the log monitor (``log_monitor.py``): it streams the workers' output to the
  driver, which only matters with ``log_to_driver=True``;
- with ``include_dashboard=False``, the dashboard process
  (``dashboard/dashboard.py``), which then loads only Ray's usage-stats module:
  it does nothing when usage stats are off (``RAY_USAGE_STATS_ENABLED=0``).

Each costs about a core-second to start, and this repository's suite starts a
cluster some 60 times (``docs/benchmarks.md``). ``ray start`` can leave out the
first two (``--no-monitor``, ``--include-log-monitor=False``); ``ray.init``
cannot, so :func:`lean_local_node` sets the same fields of Ray's node
parameters, and leaves out the idle dashboard, while one ``ray.init`` starts
its node. Ray versions that lack those hooks start their node unchanged.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LEAN_VARIABLE", "lean_local_node", "usage_stats_off"]

# "0": start the local node as Ray does, every helper included.
LEAN_VARIABLE = "RL_E2E_LEAN_RAY"

_lock = threading.Lock()


def usage_stats_off() -> bool:
    """Whether Ray's usage stats are switched off, as Ray decides it (its variable
    ``RAY_USAGE_STATS_ENABLED``, then ``ray disable-usage-stats``'s file); False if unsure."""
    try:
        from ray._common.usage.usage_lib import usage_stats_enabled

        return not usage_stats_enabled()
    except (ImportError, ValueError):  # another Ray, or a value Ray itself refuses
        return False


@contextmanager
def lean_local_node(*, log_to_driver: bool) -> Iterator[None]:
    """While the ``ray.init`` inside starts a head node: no autoscaler monitor, no log
    monitor unless ``log_to_driver``, and no dashboard process when it would be idle
    (that ``ray.init``'s ``include_dashboard=False``, and usage stats off).

    Only the node this process starts is changed, not one it joins; nothing is
    changed with ``RL_E2E_LEAN_RAY=0``.
    """
    if os.environ.get(LEAN_VARIABLE, "1") == "0":
        yield
        return
    try:
        from ray._private.node import Node
    except ImportError:  # a Ray without that module: its node as it comes
        yield
        return
    original_init = Node.__init__
    original_api_server = getattr(Node, "start_api_server", None)
    stats_off = usage_stats_off()

    def init(self: Any, ray_params: Any, *args: Any, head: bool = False, **kwargs: Any) -> None:
        if head:
            if hasattr(ray_params, "no_monitor"):
                ray_params.no_monitor = True
            if not log_to_driver and hasattr(ray_params, "include_log_monitor"):
                ray_params.include_log_monitor = False
        original_init(self, ray_params, *args, head=head, **kwargs)

    def start_api_server(self: Any, *args: Any, **kwargs: Any) -> None:
        # Ray passes the node's own include_dashboard; None (its default) starts the dashboard.
        if not (stats_off and kwargs.get("include_dashboard") is False):
            original_api_server(self, *args, **kwargs)

    with _lock:
        Node.__init__ = init
        if original_api_server is not None:
            Node.start_api_server = start_api_server
        try:
            yield
        finally:
            Node.__init__ = original_init
            if original_api_server is not None:
                Node.start_api_server = original_api_server
