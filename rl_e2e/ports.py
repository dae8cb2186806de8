"""TCP ports for servers that bind them some time after they are chosen.

A port probed with ``bind(0)`` and released at once comes from the kernel's
``ip_local_port_range``, the range every other ``bind(0)`` and every outgoing
``connect()`` on the machine also draws from. A server that binds it seconds
later (``ray start`` starts its agents 10-20 s after the dashboard; rank 0 of a
process group binds ``MASTER_PORT`` when its test gets there) can then find it
taken by another process, and fail with "Address already in use", or worse,
reach someone else's server on it. :func:`quiet_ports` chooses where nothing
is handed out behind the caller's back.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["quiet_ports"]

RAY_WORKER_PORTS_END = 19999  # Ray's default --max-worker-port: its workers take 10002-19999
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def quiet_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free now on ``host`` ("" for every interface), outside the kernel's ephemeral range and above
    Ray's worker ports, in random order so that processes choosing at once rarely meet.

    Raises:
        RuntimeError: fewer than ``n`` such ports are free.
    """
    low, high = 32768, 60999  # Linux's default, where /proc cannot be read
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, _EPHEMERAL_RANGE.read_text().split())
    candidates = [
        port for port in range(RAY_WORKER_PORTS_END + 1, 65536) if not low <= port <= high
    ]
    found: list[int] = []
    for port in random.sample(candidates, len(candidates)):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(
        f"fewer than {n} free TCP ports above {RAY_WORKER_PORTS_END} outside {low}-{high}"
    )
