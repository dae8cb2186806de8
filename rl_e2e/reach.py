"""Before ``ray.init``: is there a Ray cluster at an address, and does it want a token?

One implementation of "reach a cluster", shared by ``gpusched --ray ADDRESS``
and ``python -m trainer`` under ``RAY_ADDRESS`` (a ``ray job submit`` driver
included). Each caller names where the address came from (``label``: ``--ray``
or ``RAY_ADDRESS``), and every message starts with it.

``ray.init`` with an explicit address never turns token authentication on by
itself (only a bare ``ray.init()`` of a local cluster does, when it finds a
token), and where a cluster wants a token that the client does not send, Ray's
C++ client retries for about ten seconds, printing a line a second, then fails
with "Failed to connect to Ray cluster". So ``prepare`` asks first: one
``GetClusterId`` call to the cluster's GCS, without a token, with a bounded
deadline. The answer decides:

- it answers: the cluster has no token authentication; connect without one.
- UNAUTHENTICATED: it wants a token. Look for one where Ray's own clients do,
  through Ray's own loader: ``RAY_AUTH_TOKEN``, else the file named by
  ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. None: one line saying so
  and where to put it. Found: one more call, sending it, checks that this
  cluster takes it; then this process connects in token mode
  (``RAY_AUTH_MODE=token``, as Ray's own ``ray start`` sets it for itself).
- anything else (nothing listens, not a gRPC server, no answer in time): no
  Ray cluster there.

The cluster's answer wins over a ``RAY_AUTH_MODE`` already set here: that
variable says which mode a cluster started from this shell gets; for joining
one, only what the cluster wants matters.

Only the standard library is imported at module level: Ray (and its ``grpc``)
only inside the functions, so gpusched imports this module without importing
Ray.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from enum import Enum

PROBE_TIMEOUT = 5.0  # seconds for the TCP connection and for each GetClusterId call
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
TOKEN_VARIABLE = "RAY_AUTH_TOKEN"
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"
WHERE_TOKENS_GO = (
    f"put the cluster's token (`ray get-auth-token` on its head prints it) in "
    f"{DEFAULT_TOKEN_FILE}, or in a file named by {TOKEN_PATH_VARIABLE}, or in "
    f"{TOKEN_VARIABLE}"
)


class ClusterError(Exception):
    """The run cannot use this cluster; the message names the address or the node, and why."""


@dataclass(frozen=True)
class GcsAddress:
    """The address of a cluster's GCS, as ``ray start --head`` prints it (``HOST:PORT``)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(text: str, label: str = "--ray") -> GcsAddress:
    """``HOST:PORT`` (``[V6]:PORT`` too) as a GcsAddress; ValueError naming what is wrong.

    Pure. ``auto`` and ``ray://`` addresses are the caller's (see ``prepare``);
    ``label`` is where the address came from, for the messages.
    """
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() in ("http", "https"):
            raise ValueError(
                f"is a web address (the dashboard's?); {label} takes the address of the "
                "cluster's head as `ray start --head` prints it: HOST:PORT, port 6379 "
                "by default"
            )
        raise ValueError(f"has a scheme {scheme}:// that {label} does not know (HOST:PORT or auto)")
    host, colon, port = text.rpartition(":")
    if not colon and text.isdigit():
        raise ValueError("is a port without a host: HOST:PORT")
    if not colon:
        raise ValueError("names no port: HOST:PORT, port 6379 by default")
    if not host:
        raise ValueError("is a port without a host: HOST:PORT")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]  # an IPv6 address
    if not host or "/" in host or (":" in host and not bracketed):
        raise ValueError("is not HOST:PORT (or auto)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"has no valid port ({port!r}): HOST:PORT")
    return GcsAddress(host, int(port))


class Answer(Enum):
    """What a cluster's GCS said to one GetClusterId call."""

    OPEN = "open"  # it answered
    WANTS_TOKEN = "wants a token"  # UNAUTHENTICATED: no token, or not its token
    NONE = "no answer"  # not a GCS, or none in time


def ask(
    address: GcsAddress, token: str | None, timeout: float = PROBE_TIMEOUT
) -> tuple[Answer, str]:
    """One GetClusterId call to the GCS at ``address``, sending ``token`` if given; what it said."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(str(address)) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return Answer.WANTS_TOKEN, details or ""
            return Answer.NONE, str(getattr(code, "name", code) or details)
    return Answer.OPEN, ""


def token_source() -> str:
    """Where Ray's loader takes a token from here (for messages): the variable or the file."""
    if os.environ.get(TOKEN_VARIABLE):
        return TOKEN_VARIABLE
    if os.environ.get(TOKEN_PATH_VARIABLE):
        return f"{TOKEN_PATH_VARIABLE}={os.environ[TOKEN_PATH_VARIABLE]}"
    return DEFAULT_TOKEN_FILE


def local_token() -> str | None:
    """The token Ray's own clients would send from here, or None; ValueError if its source is bad."""
    from ray._raylet import AuthenticationTokenLoader
    from ray.exceptions import AuthenticationError

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    try:
        if not loader.has_token(ignore_auth_mode=True):
            return None
        return loader.get_raw_token(ignore_auth_mode=True) or None
    except AuthenticationError as exc:  # RAY_AUTH_TOKEN_PATH names a missing or empty file
        first = str(exc).split(". ")[0].strip().rstrip(".")
        raise ValueError(f"{first}; {WHERE_TOKENS_GO}") from None


def set_auth_mode(token: bool) -> None:
    """Make this process's Ray client send (or not) its token, as ``ray start`` does for itself."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ[AUTH_MODE_VARIABLE] = "token" if token else "disabled"
    Config.initialize("")  # Ray's cached config re-reads RAY_AUTH_MODE
    AuthenticationTokenLoader.instance().reset_cache()


def named(label: str, address: str) -> str:
    """How messages name an address: ``--ray ADDRESS`` for an option, ``RAY_ADDRESS=ADDRESS``
    for a variable."""
    return f"{label} {address}" if label.startswith("-") else f"{label}={address}"


def resolve(address: str, label: str = "--ray") -> str:
    """``auto``: ``RAY_ADDRESS``, else the cluster started on this machine (Ray's own lookup)."""
    if address != "auto":
        return address
    named_here = os.environ.get("RAY_ADDRESS")
    if named_here and named_here != "auto":  # RAY_ADDRESS=auto: Ray's lookup as well
        return named_here
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except (ConnectionError, ValueError) as exc:
        raise ClusterError(
            f"{named(label, 'auto')}: {str(exc).split('. ')[0].rstrip('.')}"
        ) from None


def prepare(address: str, timeout: float = PROBE_TIMEOUT, *, label: str = "--ray") -> str:
    """Check ``address`` and set this process's token mode; the address for ``ray.init``.

    Raises ClusterError with one line (``LABEL ADDRESS: why``, ``label`` being
    where the address came from) where there is no cluster, where the address
    is not one, and where the cluster wants a token that is not here or that it
    refuses; each answer takes at most two calls of ``timeout`` seconds. Called
    before ``ray.init`` by gpusched's ``connect`` (``--ray``) and by
    ``python -m trainer`` (``RAY_ADDRESS``); ``ray://`` (Ray Client) addresses
    go to Ray unchecked.
    """
    target = resolve(address, label)
    shown = named(label, address if target == address else f"{address} ({target})")
    if target.startswith("ray://"):
        return target
    try:
        gcs = parse_address(target, label)
    except ValueError as exc:
        raise ClusterError(f"{shown}: {exc}") from None
    try:
        socket.create_connection((gcs.host, gcs.port), timeout=timeout).close()
    except OSError as exc:
        raise ClusterError(
            f"{shown}: no Ray cluster answers at {gcs} ({exc.strerror or exc})"
        ) from None
    answer, detail = ask(gcs, None, timeout)
    if answer is Answer.NONE:
        raise ClusterError(
            f"{shown}: something listens at {gcs} but it is not a Ray cluster's head "
            f"(gRPC: {detail}); {label} takes the address `ray start --head` prints, port 6379 "
            "by default"
        )
    if answer is Answer.OPEN:
        set_auth_mode(False)
        return str(gcs)
    try:
        token = local_token()
    except ValueError as exc:
        raise ClusterError(f"{shown}: the cluster wants a token: {exc}") from None
    if token is None:
        raise ClusterError(
            f"{shown}: the cluster wants a token (token authentication) and none "
            f"was found here: {WHERE_TOKENS_GO}"
        )
    answer, detail = ask(gcs, token, timeout)
    if answer is Answer.WANTS_TOKEN:
        raise ClusterError(
            f"{shown}: the cluster refuses the token from {token_source()} "
            f"(not this cluster's?): {WHERE_TOKENS_GO}"
        )
    if answer is Answer.NONE:
        raise ClusterError(f"{shown}: the cluster stopped answering ({detail})")
    set_auth_mode(True)
    return str(gcs)
