"""The ``py_executable`` of warm-started Ray workers: hand this start to a warm process, or run it.

Ray starts a worker as ``<py_executable> default_worker.py ARGS`` in the
worker's environment, with the worker's log files as fds 1 and 2. Run as
``python -S worker_shim.py default_worker.py ARGS`` (see
:mod:`rl_e2e.warm_workers`), this script imports nothing but the standard
library and asks the node's warm process (:mod:`rl_e2e.worker_zygote`), which
has the heavy modules imported, to fork the worker with this environment,
directory, arguments and fds; the worker it forks reports its own pid to
Ray, so Ray's kills reach it. This process stays as the worker's stand-in
in its parent's eyes: it passes the signals a process may handle on to the
worker, exits with the worker's exit status, and when it is killed the
worker kills itself (it watches the connection).

Whatever goes wrong before the hand-over (no warm process can be started,
the connection drops) ends in ``exec`` of the interpreter on the same
arguments: the worker then starts cold, as it would without this script.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

PRELOAD_VARIABLE = "RL_E2E_WARM_PRELOAD"  # comma-separated modules the warm process imports
# Variables that differ between workers whose imports are the same: left out of the
# key, so that workers of every job on a node share one warm process. Coverage's
# are taken up by the worker itself after the fork; the warm process runs unmeasured.
PER_WORKER_PREFIXES = ("RAY_JOB_ID", "COVERAGE_")
START_WAIT_S = 120.0  # the warm process's imports, on a loaded machine
STATUS = struct.Struct("!i")
RAYLET_VARIABLE = "RAY_RAYLET_PID"  # Ray sets it for every worker; the warm process leaves with it
COLD = -1  # the warm process's answer instead of a pid: start this worker cold
# Signals a process may handle: passed on to the worker (Ray stops a worker with SIGTERM).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def zygote_key(environ: dict[str, str], executable: str) -> str:
    """What the warm process must share with a worker: interpreter and environment, hashed."""
    blob = json.dumps([executable, sorted(zygote_environ(environ).items())]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def zygote_address(key: str) -> str:
    """An abstract Unix socket (Linux): no file to leave behind, no path-length limit to meet."""
    return f"\0rl_e2e-warm-{os.getuid()}-{key}"


def zygote_environ(environ: dict[str, str]) -> dict[str, str]:
    """The warm process's environment: the worker's, without the per-worker variables."""
    return {k: v for k, v in environ.items() if not k.startswith(PER_WORKER_PREFIXES)}


def _cold_start(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_zygote(address: str) -> subprocess.Popen:
    """Start a warm process for this key; if another shim started one first, this one leaves."""
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_zygote.py")
    return subprocess.Popen(
        [sys.executable, server, address.lstrip("\0")],
        env=zygote_environ(dict(os.environ)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=2,  # Ray's log file of this worker: an import error shows there
        start_new_session=True,
        close_fds=True,
    )


def _wait_for_zygote(address: str) -> tuple[socket.socket | None, subprocess.Popen | None]:
    """A connection to the warm process of ``address``, and the process if this shim started it.

    The warm process listens before it imports, so a connection is accepted at
    once and served when the imports are done.
    """
    sock = _connect(address)
    if sock is not None:
        return sock, None
    zygote = _start_zygote(address)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        sock = _connect(address)
        if sock is not None:
            return sock, zygote
        if zygote.poll() is not None:  # another shim's warm process bound it first
            return _connect(address), None
        time.sleep(0.02)
    zygote.kill()
    zygote.wait()
    return None, None


def _forward_signals(worker: int) -> None:
    """Pass the signals a process may handle on to the worker, as if sent to it.

    Ray stops a worker with SIGTERM, which the worker handles (coverage saves
    what it measured, Ray exits cleanly); sent to this stand-in, it must reach
    the worker, not end the stand-in (whose end kills the worker outright).
    """

    def forward(received: int, _frame: object) -> None:
        try:
            os.kill(worker, received)
        except ProcessLookupError:  # it has ended: its status is on its way
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)


def _worker_status(sock: socket.socket) -> int:
    """Block until the warm process reports the worker's exit status (1 if it cannot)."""
    status = b""
    while len(status) < STATUS.size:
        chunk = sock.recv(STATUS.size - len(status))
        if not chunk:
            return 1
        status += chunk
    return STATUS.unpack(status)[0]


def main(argv: list[str]) -> None:
    """Run ``argv`` (``default_worker.py ARGS``) in a child of the warm process, else cold."""
    if not os.environ.get(PRELOAD_VARIABLE) or not os.environ.get(RAYLET_VARIABLE) or not argv:
        _cold_start(argv)  # nothing to preload, or no raylet whose exit ends the warm process
    address = zygote_address(zygote_key(dict(os.environ), sys.executable))
    sock, zygote = _wait_for_zygote(address)
    if sock is None:
        _cold_start(argv)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(sock, [STATUS.pack(len(request)) + request], [0, 1, 2])
        sock.settimeout(START_WAIT_S)  # the warm process's imports
        forked = sock.recv(STATUS.size)  # the worker's pid: it runs
        sock.settimeout(None)
    except OSError:  # the warm process failed its imports, or is stuck in them
        forked = b""
    if len(forked) != STATUS.size:
        sock.close()
        if zygote is not None:
            zygote.kill()
            zygote.wait()
        _cold_start(argv)
    if STATUS.unpack(forked)[0] == COLD:
        sock.close()
        _cold_start(argv)  # the warm process stays, and answers the next shims at once
    _forward_signals(STATUS.unpack(forked)[0])
    code = _worker_status(sock)
    for signum in FORWARDED:  # its pid may be another process's by now
        signal.signal(signum, signal.SIG_DFL)
    if zygote is not None:
        # The warm process stays this shim's child, in Ray's process tree, until it
        # leaves with the raylet; so does this shim.
        zygote.wait()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
