"""NCCL loopback guard: route collectives over ``lo`` on hosts that cannot reach themselves.

NCCL and gloo pick a network interface and connect every rank to the address of
that interface, even when all ranks are on one host. On some hosts (containers
with a restrictive firewall, laptops on VPNs, macOS) a process cannot open a TCP
connection to the host's own outbound IP, and process-group setup then hangs
until its timeout. Pinning NCCL/gloo to ``lo`` fixes single-node runs.

``apply_loopback_guard()`` checks first whether the routing variables are all
set (then it does nothing, not even probe); otherwise it probes once, with a
1 s timeout, whether this host can connect to its own outbound IP, and only
when it cannot sets the missing variables. A value already set is never
overridden. Applied by the repository's root ``conftest.py`` before anything
imports Ray, and by the trainer's entry point on single-node runs (call it
before ``ray.init`` so the raylet and its workers inherit the variables).

Standard library only: it runs before pytest collects anything.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping

__all__ = [
    "GUARD_VALUES",
    "apply_loopback_guard",
    "host_reaches_itself",
    "missing_guard_vars",
    "outbound_ip",
]

logger = logging.getLogger(__name__)

# The variables the guard manages and the value each gets when the host cannot
# reach its own IP. Order is the order they are reported in.
GUARD_VALUES: dict[str, str] = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}

PROBE_TIMEOUT_S = 1.0

# RFC 5737 documentation address: "connecting" a UDP socket to it only asks the
# kernel which local address would route there; no packet leaves the host.
_ROUTE_TARGET = ("192.0.2.1", 9)


def missing_guard_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """Return the guard variables that are unset (or empty) in ``environ``, with their values."""
    return {
        name: value for name, value in GUARD_VALUES.items() if not environ.get(name, "").strip()
    }


def outbound_ip() -> str | None:
    """Return the IPv4 address this host would use to leave it, or None if it has no route.

    Uses a UDP socket's ``connect``, which selects a route without sending anything.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect(_ROUTE_TARGET)
            return udp.getsockname()[0]
    except OSError:
        return None


def host_reaches_itself(
    outbound: Callable[[], str | None] = outbound_ip,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> bool:
    """Whether a TCP connection from this host to its own outbound IP succeeds.

    Listens on an ephemeral port of that address and connects to it. False
    when there is no outbound address, it cannot be bound (not an address of
    this host), or the connection fails or takes longer than ``timeout_s``.
    ``outbound`` is injectable so tests can give a fake address.
    """
    ip = outbound()
    if ip is None:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        try:
            server.bind((ip, 0))
            server.listen(1)
        except OSError:
            return False
        port = server.getsockname()[1]
        try:
            with socket.create_connection((ip, port), timeout=timeout_s):
                return True
        except OSError:
            return False


def apply_loopback_guard(
    environ: MutableMapping[str, str] | None = None,
    probe: Callable[[], bool] = host_reaches_itself,
) -> dict[str, str]:
    """Set the missing routing variables to loopback if this host cannot reach itself.

    Args:
        environ: where to read and set the variables (default ``os.environ``).
        probe: returns True when the host can reach its own IP; called at most
            once, and not at all when every guard variable is already set.

    Returns:
        The variables that were set (empty when nothing was missing or the
        host reaches itself). Values already present are never changed.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    missing = missing_guard_vars(env)
    if not missing:
        return {}
    if probe():
        return {}
    env.update(missing)
    logger.warning(
        "this host cannot connect to its own IP; routing collectives over loopback: %s",
        " ".join(f"{name}={value}" for name, value in missing.items()),
    )
    return missing
