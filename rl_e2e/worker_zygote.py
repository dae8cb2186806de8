"""The warm process of a node's Ray workers: imports the heavy modules once, forks each worker.

Started by the first :mod:`rl_e2e.worker_shim` of a key (interpreter and
environment), as ``python worker_zygote.py NAME``: it listens on the abstract
Unix socket NAME, imports the modules named in ``RL_E2E_WARM_PRELOAD`` and
then forks one child per request. A child takes the request's environment,
directory, arguments and fds 0-2 and runs Ray's ``default_worker.py`` as
``__main__``, as the interpreter would have. Its heavy imports are already done.

A child is not a copy of its siblings where it matters: Python's ``random``
and NumPy reseed themselves in a forked child; coverage is started from
the request's environment (the warm process is never measured, and only
third-party modules are preloaded, so every measured line still runs in the
child). The warm process starts no thread and touches no device, so a child
starts without torch threads or CUDA state.

It leaves when the raylet that started its first worker (``RAY_RAYLET_PID``)
is gone; its children, Ray workers, leave with their raylet as always.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback

# This file's folder is sys.path[0]: the shim beside it is found by its own name.
from worker_shim import COLD, PRELOAD_VARIABLE, RAYLET_VARIABLE, STATUS

sys.path.pop(0)  # and its modules' names would hide others' (coverage)

MAX_FDS = 3
PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid
POLL_S = 0.5


def main(name: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError:  # another shim started the warm process of this key first
        return
    listener.listen(128)  # shims that come meanwhile are served after the imports
    before = dict(os.environ)
    try:
        for module in filter(None, os.environ.get(PRELOAD_VARIABLE, "").split(",")):
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import error: every worker of this key starts cold
        traceback.print_exc()  # into the log of the worker whose shim started this process
        broken = True
    else:
        broken = False
    # What the imports set in the environment (torch's TORCHINDUCTOR_CACHE_DIR): a
    # worker that had imported them itself would have it on top of its own.
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    raylet = _raylet_pidfd()
    shims: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, raylet], [], [], POLL_S)
        _reap(shims)
        if raylet in ready:  # the raylet is gone: so are its workers
            os._exit(0)
        if listener in ready and broken:
            _refuse(listener)
        elif listener in ready:
            _serve(listener, shims, imported, raylet)


def _raylet_pidfd() -> int:
    """A pidfd of the raylet that started the first worker: readable when it has exited."""
    try:
        return os.pidfd_open(int(os.environ[RAYLET_VARIABLE]))
    except ProcessLookupError:
        os._exit(0)


def _serve(
    listener: socket.socket,
    shims: dict[int, socket.socket],
    imported: dict[str, str],
    raylet: int,
) -> None:
    conn = _accept(listener)
    if conn is None:
        return
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError):
        conn.close()
        return
    pid = os.fork()
    if pid == 0:  # what the warm process holds is none of the worker's business
        listener.close()
        os.close(raylet)
        for other in shims.values():
            other.close()
        _become_worker(conn, {**request["env"], **imported}, request, fds)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(STATUS.pack(pid))
    except OSError:
        pass  # the shim is gone: the child sees it too and ends itself
    shims[pid] = conn


def _refuse(listener: socket.socket) -> None:
    """Tell a shim to start its worker cold (the preload failed: see the first worker's log)."""
    conn = _accept(listener)
    if conn is None:
        return
    with conn:
        try:
            _, fds = _receive(conn)
        except (OSError, ValueError):
            return
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(STATUS.pack(COLD))


def _accept(listener: socket.socket) -> socket.socket | None:
    """The next connection, if it comes from this user's processes.

    An abstract socket has no file permissions: any local user could connect,
    and a connection asks for a process running their command as this user.
    """
    conn, _ = listener.accept()
    _, uid, _ = PEER.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER.size))
    if uid != os.getuid():
        conn.close()
        return None
    return conn


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    if len(fds) != MAX_FDS or len(data) < STATUS.size:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request carries its length and fds 0, 1 and 2")
    (size,) = STATUS.unpack(data[: STATUS.size])
    body = data[STATUS.size :]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("the request ended early")
        body += chunk
    return json.loads(body), fds


def _reap(shims: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = shims.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(STATUS.pack(code if code >= 0 else 128 - code))
        except OSError:
            pass
        conn.close()


def _become_worker(
    conn: socket.socket,
    environ: dict[str, str],
    request: dict,
    fds: list[int],
) -> None:
    """In the child: become the worker the shim would have exec'd, then exit as it would."""
    # A process group of its own, as Ray gives a worker it starts: the raylet kills a
    # dead worker's group, which would otherwise be the warm process's and its siblings'.
    os.setpgid(0, 0)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(request["cwd"])
    threading.Thread(target=_die_with_shim, args=(conn,), daemon=True).start()
    argv = request["argv"]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    _measure()
    import runpy

    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def _die_with_shim(conn: socket.socket) -> None:
    """Kill this worker when its shim, the process Ray started, is gone."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _measure() -> None:
    """Start coverage as its ``.pth`` file would in a process started with this environment."""
    if os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START"):
        import coverage

        coverage.process_startup()


if __name__ == "__main__":
    main(sys.argv[1])
