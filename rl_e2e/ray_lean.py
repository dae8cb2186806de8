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
cluster some 60 times (``docs/benchmarks.md``). The process that starts the
node also pays for Ray's check whether its dashboard's packages are installed
(``ray[default]`` or plain ``ray``, which decides the agent's ``--minimal``):
Ray imports them all (aiohttp, grpc, OpenTelemetry, pydantic...), about 0.4
core-seconds that process never uses again. :func:`dashboard_dependency_error`
answers the same question by finding those packages without importing them. ``ray start`` can leave out the
first two (``--no-monitor``, ``--include-log-monitor=False``); ``ray.init``
cannot, so :func:`lean_local_node` sets the same fields of Ray's node
parameters, and leaves out the idle dashboard, while one ``ray.init`` starts
its node. Ray versions that lack those hooks start their node unchanged.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["LEAN_VARIABLE", "dashboard_dependency_error", "lean_local_node", "usage_stats_off"]

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


def _optional_dependencies() -> list[str] | None:
    """The top-level packages Ray's ``ray.dashboard.optional_deps`` imports, read from its
    source; None where that module cannot be found or read."""
    spec = importlib.util.find_spec("ray.dashboard.optional_deps")
    if spec is None or not spec.origin:
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
    return sorted(set(names))


def dashboard_dependency_error(
    find_spec: Any = importlib.util.find_spec,
) -> ImportError | None:
    """Ray's ``get_dashboard_dependency_error`` without importing the packages: None if every
    package of ``ray[default]``'s dashboard is installed, else an ImportError naming one.

    Where Ray's list of those packages cannot be read, they are imported, as Ray does.
    """
    names = _optional_dependencies()
    if names is None:  # Ray's own way: import them
        try:
            import ray.dashboard.optional_deps  # noqa: F401
        except ImportError as missing:
            return missing
        return None
    for name in names:
        if find_spec(name) is None:
            return ImportError(f"No module named {name!r}", name=name)
    return None


@contextmanager
def lean_local_node(*, log_to_driver: bool) -> Iterator[None]:
    """While the ``ray.init`` inside starts a head node: no autoscaler monitor, no log
    monitor unless ``log_to_driver``, and no dashboard process when it would be idle
    (that ``ray.init``'s ``include_dashboard=False``, and usage stats off); Ray's check
    of the dashboard's packages finds them instead of importing them.

    Only the node this process starts is changed, not one it joins; nothing is
    changed with ``RL_E2E_LEAN_RAY=0``.
    """
    if os.environ.get(LEAN_VARIABLE, "1") == "0":
        yield
        return
    try:
        import ray._private.utils as ray_utils
        from ray._private.node import Node
    except ImportError:  # a Ray without those modules: its node as it comes
        yield
        return
    original_init = Node.__init__
    original_api_server = getattr(Node, "start_api_server", None)
    original_check = getattr(ray_utils, "get_dashboard_dependency_error", None)
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
        if original_check is not None:
            ray_utils.get_dashboard_dependency_error = dashboard_dependency_error
        try:
            yield
        finally:
            Node.__init__ = original_init
            if original_api_server is not None:
                Node.start_api_server = original_api_server
            if original_check is not None:
                ray_utils.get_dashboard_dependency_error = original_check
