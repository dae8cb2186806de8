"""The fork server: one process per run that pays start-up once and forks one child per file.

Started by the runner (``gpusched.execution.forkclient``) as ``python .../gpusched/execution/forkserver.py FD
CONFIG`` (a script: it imports only the standard library and pytest), where ``FD`` is its end of a socket pair. It imports pytest, warms up
pytest's plugin machinery with one ``--collect-only`` session on an empty
directory (which imports every installed plugin through pytest's own
assertion-rewriting hook, as a fresh child would; the directory, ``CONFIG["warm"]``,
is made and removed by the runner, since the server may be killed before it could
remove one of its own), imports the preload modules
(``torch``, ...) one by one, checks that nothing unsafe happened, freezes the
heap (``gc.freeze``) and says ``ready``. Then, for each request, it forks a
child that takes its own process group, its log as stdout/stderr, the complete
environment the runner computed (``CUDA_VISIBLE_DEVICES``, ``RAY_TMPDIR``,
``MASTER_PORT``, the job tag), and runs ``pytest.main`` on its file in-process.
Every child starts from the server's state, never from a sibling's: what a file
does to ``os.environ``, ``sys.path`` or module attributes dies with it.

Unsafe, reported instead of ``ready`` (the runner then falls back to fresh
processes, or drops an automatically found module and tries again): a Python
thread besides the main one, or CUDA initialised (``torch.cuda.is_initialized()``
or the driver's ``cuda-*`` threads). Native worker pools that libraries start at
import (OpenBLAS starts one at ``import numpy``) are allowed: they register fork
handlers, and the child re-creates them on first use.

Messages are JSON lines. Runner to server: ``{"id", "args", "env", "log", "cwd",
"tag"}``. Server to runner: ``{"event": "ready"|"unsafe", ...}`` once, then
``{"event": "started", "id", "pid"}`` and ``{"event": "exit", "pid", "code", "cpu"}``
(``code`` as ``subprocess`` reports it: negative for a signal; ``cpu`` the CPU
seconds of the child and the children it reaped, from ``wait4``). End of file on
the socket stops the server; its children are the runner's to kill.
"""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.metadata
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
import weakref
from collections.abc import Sequence
from typing import Any

TAG_PLACEHOLDER_WIDTH = 64  # room for a job tag in the child's /proc/PID/environ
PAD_VARIABLE = "GPUSCHED_PAD"
CHILD_FAILED = 70  # the child could not set itself up (log says why)

_encode = json.JSONEncoder(separators=(",", ":")).encode  # bound now: a test may replace json.dumps


def unsafe_state() -> str | None:
    """Why forking this process now would be unsafe, or None.

    Python threads may hold locks the child inherits; CUDA cannot be used
    in a child forked after it was initialised, and would be initialised
    before the child knows its cards.
    """
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"Python thread(s) running: {', '.join(sorted(threads))}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "CUDA is initialised (torch.cuda.is_initialized())"
    if any(name.startswith("cuda") for name in native_thread_names()):
        return "CUDA driver threads are running (CUDA was initialised)"
    return None


def native_thread_names() -> list[str]:
    """Names (``comm``) of this process's other native threads, from ``/proc`` (Linux)."""
    names = []
    me = str(threading.get_native_id())
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        if task == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as handle:
                names.append(handle.read().strip())
        except OSError:
            continue
    return names


class _RememberedDistribution(importlib.metadata.PathDistribution):
    """An installed distribution whose metadata, entry points and file list are parsed once.

    pytest reads them for every installed package at each start-up (plugin
    entry points, the modules to rewrite, the header's plugin versions): about
    15 ms per child with a few hundred packages installed. Parsed in the
    server, they are inherited by every child.
    """

    _base = importlib.metadata.PathDistribution
    metadata = functools.cached_property(_base.metadata.fget)  # type: ignore[assignment]
    entry_points = functools.cached_property(_base.entry_points.fget)  # type: ignore[assignment]
    files = functools.cached_property(_base.files.fget)  # type: ignore[assignment]


class RememberedDistributions:
    """``importlib.metadata.distributions()`` answered from the server's list while pytest starts.

    Installed in the server before pytest's warm-up (which parses what pytest
    needs) and inherited by every child, which restores the real function as
    its collection begins: its tests see the installed packages as they are.
    """

    def __init__(self) -> None:
        self.original = importlib.metadata.distributions
        self.remembered: list[Any] | None = None

    def install(self) -> None:
        importlib.metadata.distributions = self._distributions  # type: ignore[assignment]

    def restore(self) -> None:
        importlib.metadata.distributions = self.original

    def _distributions(self, **kwargs: Any) -> Any:
        if kwargs:
            return self.original(**kwargs)
        if self.remembered is None:
            self.remembered = [
                _RememberedDistribution(dist._path)
                if type(dist) is importlib.metadata.PathDistribution
                else dist
                for dist in self.original()
            ]
        return iter(self.remembered)

    def restoring_plugin(self) -> object:
        """A pytest plugin that restores the real function once the session has started."""
        import pytest

        remembered = self

        class Restore:
            @pytest.hookimpl(trylast=True)  # after the terminal's header read the versions
            def pytest_sessionstart(self) -> None:
                remembered.restore()

        return Restore()


DISTRIBUTIONS = RememberedDistributions()


class PrebuiltConfig:
    """A pytest ``Config`` with its built-in plugins registered, made once in the server.

    ``pytest.main`` starts by making one (``_pytest.config.get_config``):
    importing and registering about 30 built-in plugins, about 20 ms of CPU
    in every child, and nothing in it depends on the file or the arguments but
    the invocation parameters and ``-p no:NAME`` (which must block a plugin
    before it registers). So the server makes one, each child inherits its own
    copy, and the child's ``pytest.main`` is handed it with the child's
    invocation parameters; a child whose arguments name ``-p`` makes its own.
    """

    def __init__(self) -> None:
        self.config: Any = None

    def build(self) -> None:
        from _pytest import config

        self.config = config.get_config(None, None, prog="pytest.main()")

    def offer(self, args: Sequence[str]) -> None:
        """In the child: the next ``get_config`` call (pytest.main's) gets the prebuilt config."""
        if self.config is None or any(arg.startswith("-p") for arg in args):
            return
        from pathlib import Path

        from _pytest import config as module

        real, prebuilt = module.get_config, self.config

        def get_config(args: Any = None, plugins: Any = None, *, prog: Any = None) -> Any:
            module.get_config = real  # once: a test that calls it gets a fresh one
            prebuilt.invocation_params = module.Config.InvocationParams(
                args=args or (), plugins=plugins, dir=Path.cwd()
            )
            return prebuilt

        module.get_config = get_config


PREBUILT = PrebuiltConfig()


def _write(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((_encode(message) + "\n").encode())


def _warm_up_pytest(empty: str) -> None:
    """One ``--collect-only`` session on the directory ``empty``, output discarded.

    It imports the installed plugins through pytest's assertion-rewriting hook
    (a child then finds them imported the way it would have imported them,
    without a "cannot be rewritten" warning) and pytest's lazily imported
    modules. pytest undoes its own configuration when the session ends.
    """
    import pytest

    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    addopts = os.environ.pop("PYTEST_ADDOPTS", None)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", empty, empty])
    finally:
        if addopts is not None:
            os.environ["PYTEST_ADDOPTS"] = addopts
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def import_preload(name: str) -> None:
    """Import a preload entry: ``a.b`` as ``import a.b``, ``a.b:c`` as ``from a.b import c``."""
    module_name, _, attribute = name.partition(":")
    module = importlib.import_module(module_name)
    if attribute:
        try:
            getattr(module, attribute)  # a library's lazy attribute imports its module here
        except AttributeError:
            importlib.import_module(f"{module_name}.{attribute}")


def prepare(preload: Sequence[str], auto: Sequence[str], warm: str) -> dict[str, Any]:
    """Import pytest, the plugins and the preload modules; the ``ready``/``unsafe`` message.

    ``warm`` is an empty directory for pytest's warm-up session (the runner's to remove).

    A user-named module that fails to import is an error; an automatically
    found one is dropped. The state is checked after each step so the message
    names the module that made it unsafe.
    """
    import pytest  # noqa: F401 - the point is to have it imported

    DISTRIBUTIONS.install()
    _warm_up_pytest(warm)
    problem = unsafe_state()
    if problem:
        return {
            "event": "unsafe",
            "module": None,
            "auto": False,
            "reason": f"pytest plugins: {problem}",
        }
    PREBUILT.build()
    loaded, dropped = [], []
    for name, automatic in [*((n, False) for n in preload), *((n, True) for n in auto)]:
        if name in loaded:
            continue
        try:
            import_preload(name)
        except BaseException as exc:  # noqa: BLE001 - an import may raise anything, even SystemExit
            if not automatic:
                return {
                    "event": "unsafe",
                    "module": name,
                    "auto": False,
                    "reason": f"preload {name!r} failed to import: {type(exc).__name__}: {exc}",
                }
            dropped.append({"module": name, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        problem = unsafe_state()
        if problem:
            return {"event": "unsafe", "module": name, "auto": automatic, "reason": problem}
        loaded.append(name)
    gc.collect()
    gc.freeze()  # children's collections skip the server's objects: no copy-on-write of the heap
    return {
        "event": "ready",
        "preloaded": loaded,
        "dropped": dropped,
        "native_threads": native_thread_names(),
    }


def retag_environ_block(block: bytes, placeholder: bytes, tag: str) -> bytes | None:
    """``block`` with the placeholder's value replaced by ``tag``, same length; None if absent.

    ``block`` is the process's initial environment as ``/proc/PID/environ``
    shows it. The placeholder entry ``GPUSCHED_JOB_TAG=<placeholder>`` becomes
    ``GPUSCHED_JOB_TAG=<tag>`` followed by a padding variable, so every entry
    stays NUL-terminated and non-empty (psutil stops at an empty entry).
    """
    at = block.find(placeholder)
    if at < 0:
        return None
    value_at = block.rfind(b"=", 0, at + len(placeholder)) + 1
    width = at + len(placeholder) - value_at
    filler = width - len(tag) - 1 - len(PAD_VARIABLE) - 1
    if filler < 0:
        return None
    new_value = tag.encode() + b"\0" + PAD_VARIABLE.encode() + b"=" + b"x" * filler
    return block[:value_at] + new_value + block[value_at + width :]


def _retag_proc_environ(placeholder: str, tag: str) -> None:
    """Make ``/proc/self/environ`` carry the job tag, so the kill sweep finds this child.

    A forked child shows its parent's initial environment there whatever it
    puts in ``os.environ``; processes it forks without ``exec`` inherit that
    block too. The server was started with a placeholder tag of fixed width,
    which is overwritten here in place. Best effort: without it the child is
    still found by its pid and process group.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = mem.read(end - start)
            new = retag_environ_block(block, placeholder.encode(), tag)
            if new is not None:
                mem.seek(start)
                mem.write(new)
    except (OSError, ValueError, IndexError):
        pass


def disown_server_finalizers() -> int:
    """Keep the server's ``weakref.finalize`` callbacks from running at this child's exit.

    They were registered for objects the server made (torch registers one per
    operator library: about 30 ms of C++ teardown at every exit), and they
    clean up for the server: one that removes a temporary directory the server
    made would remove it under every later child. Finalizers the child
    registers itself still run at its exit, and any finalizer still runs when
    its object is collected. Returns how many were disowned.
    """
    registry = getattr(weakref.finalize, "_registry", None)
    if not isinstance(registry, dict):
        return 0
    disowned = 0
    for finalizer in list(registry):
        if finalizer.atexit:
            finalizer.atexit = False
            disowned += 1
    return disowned


def _become_child(request: dict[str, Any], keep_closed: Sequence[int], placeholder: str) -> int:
    """In the forked child: take the job's process group, log, environment; run pytest."""
    os.setpgid(0, 0)
    disown_server_finalizers()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in keep_closed:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdout = open(
        1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )  # noqa: SIM115
    sys.stderr = open(
        2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )  # noqa: SIM115
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    _retag_proc_environ(placeholder, request["tag"])
    os.chdir(request["cwd"])
    import pytest

    sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *request["args"]]
    try:
        PREBUILT.offer(request["args"])
        code = pytest.main(list(request["args"]), plugins=[DISTRIBUTIONS.restoring_plugin()])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return int(code)


def _child_main(request: dict[str, Any], keep_closed: Sequence[int], placeholder: str) -> None:
    code = CHILD_FAILED
    try:
        code = _become_child(request, keep_closed, placeholder)
        import atexit

        atexit._run_exitfuncs()  # what the interpreter would run at exit: coverage data, ...
    except BaseException:  # noqa: BLE001 - report anything and leave through os._exit
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001, S110 - stderr may be gone
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110
                pass
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu = round(usage.ru_utime + usage.ru_stime, 3)  # the child's and those it reaped
        code = os.waitstatus_to_exitcode(status)
        _write(sock, {"event": "exit", "pid": pid, "code": code, "cpu": cpu})


def serve(sock: socket.socket, placeholder: str) -> None:
    """Fork a child per request and report each child's exit, until the runner hangs up."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buffer = b""
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap(sock)
        if sock not in readable:
            continue
        data = sock.recv(1 << 16)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child_main(request, (sock.fileno(), wake_r, wake_w), placeholder)
            try:
                os.setpgid(pid, pid)  # also here: the runner may signal the group at once
            except OSError:
                pass
            _write(sock, {"event": "started", "id": request["id"], "pid": pid})
        _reap(sock)


def main(argv: Sequence[str]) -> int:
    """``python forkserver.py FD CONFIG_JSON``."""
    fd, config = int(argv[0]), json.loads(argv[1])
    # As under ``python -m pytest``: the working directory first on sys.path, not this
    # script's directory (whose modules would shadow a suite's ``plugin`` or ``runner``).
    sys.path[0] = os.getcwd()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner handles Ctrl-C for everyone
    sock = socket.socket(fileno=fd)
    hello = prepare(config["preload"], config["auto"], config["warm"])
    _write(sock, hello)
    if hello["event"] != "ready":
        return 0
    serve(sock, config["placeholder"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
