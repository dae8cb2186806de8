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
overridden. Applied by the e2e plugin (``rl_e2e.plugin``) when pytest starts,
before any test module imports Ray, and by the trainer's entry point on
single-node runs (call it before ``ray.init`` so the raylet and its workers
inherit the variables). It also names a routing variable that selects no
interface of this host, which NCCL and gloo would only show as a hang.

Standard library only: it runs before pytest collects anything.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

__all__ = [
    "GUARD_VALUES",
    "GuardDecision",
    "apply_loopback_guard",
    "local_interfaces",
    "loopback_guard",
    "socket_ifname_problems",
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


@dataclass(frozen=True)
class GuardDecision:
    """What the loopback guard found and did, for the pytest header and the logs.

    ``set_now`` holds the variables it set; ``already_set`` the guard variables
    that were set before it ran; ``reachable`` the probe's answer (``None`` when
    nothing was missing, so it did not probe); ``problems`` names the routing
    variables that point at interfaces this host does not have.
    """

    set_now: dict[str, str]
    already_set: dict[str, str]
    reachable: bool | None
    probe_ms: float | None
    problems: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: what was decided and why."""
        if self.reachable is None:
            what = "nothing to do: " + " ".join(f"{k}={v}" for k, v in self.already_set.items())
            what += " already set"
        elif self.reachable:
            what = f"this host reaches its own IP (probe {self.probe_ms:.0f} ms); nothing set"
        else:
            what = (
                f"this host cannot reach its own IP (probe {self.probe_ms:.0f} ms); set "
                + " ".join(f"{k}={v}" for k, v in self.set_now.items())
            )
        return what + "".join(f"; PROBLEM: {problem}" for problem in self.problems)


def local_interfaces() -> list[str]:
    """The names of this host's network interfaces (``lo``, ``eth0``, ...)."""
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return []


def socket_ifname_problems(
    environ: Mapping[str, str], interfaces: Sequence[str] | None = None
) -> tuple[str, ...]:
    """Name each routing variable that selects no interface of this host.

    ``NCCL_SOCKET_IFNAME`` is a comma-separated list of name prefixes (``=eth0``
    an exact name, a leading ``^`` an exclusion list, which is not checked);
    ``GLOO_SOCKET_IFNAME`` a comma-separated list of exact names. NCCL and gloo
    otherwise fail at rendezvous without saying why.
    """
    names = local_interfaces() if interfaces is None else list(interfaces)
    if not names:
        return ()
    problems = []
    nccl = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        wanted = [w.strip() for w in nccl.lstrip("=").split(",") if w.strip()]
        if not any(
            (name == want) if exact else name.startswith(want) for want in wanted for name in names
        ):
            problems.append(
                f"NCCL_SOCKET_IFNAME={nccl} matches no interface of this host ({', '.join(names)})"
            )
    gloo = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    missing = [w.strip() for w in gloo.split(",") if w.strip() and w.strip() not in names]
    if missing:
        problems.append(
            f"GLOO_SOCKET_IFNAME={gloo} names {', '.join(missing)}, not an interface of "
            f"this host ({', '.join(names)})"
        )
    return tuple(problems)


def loopback_guard(
    environ: MutableMapping[str, str] | None = None,
    probe: Callable[[], bool] = host_reaches_itself,
    interfaces: Sequence[str] | None = None,
) -> GuardDecision:
    """Set the missing routing variables to loopback if this host cannot reach itself.

    Args:
        environ: where to read and set the variables (default ``os.environ``).
        probe: returns True when the host can reach its own IP; called at most
            once, and not at all when every guard variable is already set.
        interfaces: this host's interface names (default: asked of the OS), to
            check the routing variables against.

    Returns:
        The decision: what was set (values already present are never changed),
        what the probe said, and any routing variable naming no interface.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    missing = missing_guard_vars(env)
    already = {name: env[name] for name in GUARD_VALUES if name not in missing}
    reachable: bool | None = None
    probe_ms: float | None = None
    set_now: dict[str, str] = {}
    if missing:
        started = time.perf_counter()
        reachable = probe()
        probe_ms = (time.perf_counter() - started) * 1000
        if not reachable:
            env.update(missing)
            set_now = dict(missing)
            logger.warning(
                "this host cannot connect to its own IP; routing collectives over loopback: %s",
                " ".join(f"{name}={value}" for name, value in missing.items()),
            )
    problems = socket_ifname_problems(env, interfaces)
    for problem in problems:
        logger.warning("%s", problem)
    return GuardDecision(set_now, already, reachable, probe_ms, problems)


def apply_loopback_guard(
    environ: MutableMapping[str, str] | None = None,
    probe: Callable[[], bool] = host_reaches_itself,
) -> dict[str, str]:
    """:func:`loopback_guard`, returning only the variables it set (empty if none)."""
    return loopback_guard(environ, probe).set_now
