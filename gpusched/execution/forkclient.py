"""The runner's side of the fork server (``gpusched.execution.forkserver``): start it, ask for children, hear exits.

One ``ForkServer`` per run, owned by the session: started before collection,
used synchronously by collection and asynchronously by the runner (its socket
is then read by the event loop), closed at the end of the run. A child it
forks is a ``ForkedProcess``: a pid (also its process group), an exit code
learnt from the server, and ``wait()``; the runner kills it as a tree exactly
like a ``python -m pytest`` subprocess.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.execution.forkserver import TAG_PLACEHOLDER_WIDTH
from gpusched.execution.preload import auto_preload, fork_unavailable, guess_rootdir
from gpusched.execution.proctree import TAG_VARIABLE, kill_job

# Run as a script, not ``-m gpusched.execution.forkserver``: the gpusched package must first be imported
# by pytest itself (as a plugin, through its assertion-rewriting hook), as in a fresh child.
SERVER_SCRIPT = str(Path(__file__).with_name("forkserver.py"))
SERVER_DIED = -1  # exit code reported for children whose server went away before they did
MAX_AUTO_RETRIES = 3


class ServerGone(RuntimeError):
    """The fork server exited or stopped answering."""


@dataclass(frozen=True)
class ServerSpec:
    """What a fork server is started with."""

    preload: tuple[str, ...]  # named by the user: failing to import is an error
    auto: tuple[str, ...]  # found automatically: dropped if missing or unsafe
    env: Mapping[str, str]  # the runner's environment (the server's is derived from it)
    log_path: Path  # the server's own output
    run_id: str
    timeout: float  # seconds to wait for the server to be ready
    # Where the server's warm-up directory is made (None: the temp dir). An owner that can die
    # before it closes the server gives a directory that is removed all the same (an agent's).
    scratch: Path | None = None


# The least a fork server is given to import pytest, its plugins and the preloads before the
# run goes on without it. A slow machine can take longer than a small --collect-timeout for
# that; falling back to a fresh process per file would cost the run far more than waiting.
SERVER_START_MIN_S = 60.0


def server_start_timeout(collect_timeout: float) -> float:
    """How long a run waits for its fork server to be ready: the collection's bound, at least a minute."""
    return max(float(collect_timeout), SERVER_START_MIN_S)


def server_spec(
    paths: Sequence[str], settings: Mapping[str, Any], run_id: str, log_dir: Path
) -> ServerSpec | str:
    """What the run's fork server starts with, or why this platform has none."""
    why = fork_unavailable()
    if why:
        return why
    rootdir = guess_rootdir(paths, Path.cwd())
    preload = tuple(settings.get("preload", ()))
    log_dir.mkdir(parents=True, exist_ok=True)
    return ServerSpec(
        preload,
        tuple(name for name in auto_preload(paths, rootdir) if name not in preload),
        os.environ,
        log_dir / "forkserver.log",
        run_id,
        server_start_timeout(settings["collect_timeout"]),
    )


@dataclass
class EarlyServer:
    """A fork server started as soon as the options were known, before the session was imported.

    The session takes it over (``taken``); whoever started it kills it if not.
    """

    spec: ServerSpec
    server: ForkServer
    taken: bool = False

    def discard(self) -> None:
        if not self.taken:
            self.server.close(wait=0.0)


def start_early_server(
    paths: Sequence[str], settings: Mapping[str, Any], log_dir: Path
) -> EarlyServer | None:
    """The run's fork server, started now and not waited for; None where there is none.

    The command line calls this before it imports the rest of gpusched, so the
    server's imports (torch: seconds) begin sooner (about 40 ms here). The
    run id is the spec's.
    """
    if not settings.get("fork_server", True):
        return None
    spec = server_spec(paths, settings, new_run_id(), log_dir)
    if isinstance(spec, str):
        return None
    try:
        return EarlyServer(spec, ForkServer.launch(spec, wait=False))
    except OSError:
        return None


def new_run_id() -> str:
    """A run's id: names its job tags and the fork server's placeholder."""
    return uuid.uuid4().hex[:10]


@dataclass
class Startup:
    """The outcome of starting the server: the server, or why not; notes to print once."""

    server: ForkServer | None
    reason: str | None = None
    notes: list[str] = field(default_factory=list)


class ForkedProcess:
    """A child of the fork server, with the slice of ``asyncio.subprocess.Process`` the runner uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    @property
    def exit_cpu(self) -> float | None:
        """CPU seconds the child and the children it reaped used, once it has exited."""
        return self.server.exit_cpu.get(self.pid)

    async def wait(self) -> int:
        return await asyncio.shield(self.server.exit_future(self.pid))


def placeholder_tag(run_id: str) -> str:
    """The server's own job tag: unique to the run, wide enough for any child's tag."""
    return f"fs-{run_id}-".ljust(TAG_PLACEHOLDER_WIDTH, "_")


def server_env(base: Mapping[str, str], placeholder: str) -> dict[str, str]:
    """The server's environment: no card visible, no ``RAY_ADDRESS``, the placeholder tag last.

    Each child replaces it all with its own; a preload that initialised CUDA
    regardless would find no card rather than someone else's.
    """
    env = {k: v for k, v in base.items() if k not in ("RAY_ADDRESS", TAG_VARIABLE)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    env[TAG_VARIABLE] = placeholder  # last: its block is rewritten in place by each child
    return env


class ForkServer:
    """A running fork server. Not thread-safe: used from the session, then from the event loop."""

    def __init__(
        self, proc: subprocess.Popen, sock: socket.socket, placeholder: str, warm: str
    ) -> None:
        self.proc = proc
        self.sock = sock
        self.placeholder = placeholder
        self.warm = warm  # the empty directory of its warm-up; removed by ``close``
        self.exits: dict[int, int] = {}
        self.exit_cpu: dict[int, float] = {}  # a child's CPU seconds, from its wait status
        self.hello: dict[str, Any] = {}
        self.timeout = 300.0  # seconds to wait for the hello
        self._started: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._buffer = b""
        self._gone = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_futures: dict[int, asyncio.Future[int]] = {}
        self._exit_futures: dict[int, asyncio.Future[int]] = {}

    @classmethod
    def launch(cls, spec: ServerSpec, wait: bool = True) -> ForkServer:
        """Start the server process and wait for its first message (``hello``).

        With ``wait=False`` it returns at once; ``ready`` waits later. The
        server's warm-up directory is made here and removed by ``close``, once
        the server is gone: a server killed during its warm-up (``close``, a
        sweep) could not remove one of its own.
        """
        placeholder = placeholder_tag(spec.run_id)
        warm = tempfile.mkdtemp(prefix="gpusched-warm-", dir=spec.scratch)
        ours, theirs = socket.socketpair()
        config = json.dumps(
            {
                "preload": list(spec.preload),
                "auto": list(spec.auto),
                "placeholder": placeholder,
                "warm": warm,
            }
        )
        try:
            with open(spec.log_path, "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, SERVER_SCRIPT, str(theirs.fileno()), config],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=server_env(spec.env, placeholder),
                    pass_fds=(theirs.fileno(),),
                    process_group=0,
                )
        except BaseException:
            ours.close()
            shutil.rmtree(warm, ignore_errors=True)
            raise
        finally:
            theirs.close()
        server = cls(proc, ours, placeholder, warm)
        server.timeout = spec.timeout
        if wait:
            server.ready()
        return server

    def ready(self) -> dict[str, Any]:
        """Wait for the server's first message (``ready`` or ``unsafe``), once; it is ``hello``."""
        if not self.hello:
            try:
                self.hello = self._next_message(self.timeout)
            except BaseException:
                self.close()
                raise
        return self.hello

    # ------------------------------------------------------------------ messages

    def _feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            match message.get("event"):
                case "started":
                    self._started[message["id"]] = message["pid"]
                    future = self._start_futures.pop(message["id"], None)
                    if future is not None and not future.done():
                        future.set_result(message["pid"])
                case "exit":
                    self.exits[message["pid"]] = message["code"]
                    if "cpu" in message:
                        self.exit_cpu[message["pid"]] = message["cpu"]
                    future = self._exit_futures.get(message["pid"])
                    if future is not None and not future.done():
                        future.set_result(message["code"])
                case _:
                    messages.append(message)
        return messages

    def _lost(self) -> None:
        """The server is gone: nobody will report the children's exits any more."""
        self._gone = True
        for future in self._start_futures.values():
            if not future.done():
                future.set_exception(ServerGone("the fork server exited"))
        for pid, future in self._exit_futures.items():
            self.exits.setdefault(pid, SERVER_DIED)
            if not future.done():
                future.set_result(SERVER_DIED)

    def _receive(self, timeout: float | None) -> list[dict[str, Any]]:
        """Block until some data arrives (or ``timeout``); the non-child messages it completed."""
        if self._gone:
            raise ServerGone("the fork server exited")
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            return []
        data = self.sock.recv(1 << 16)
        if not data:
            self._lost()
            raise ServerGone("the fork server exited")
        return self._feed(data)

    def _next_message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerGone(f"the fork server did not answer within {timeout:g}s")
            messages = self._receive(left)
            if messages:
                return messages[0]

    def _request(self, args: Sequence[str], env: Mapping[str, str], log: Path, tag: str) -> int:
        request_id = next(self._ids)
        message = {
            "id": request_id,
            "args": list(args),
            "env": dict(env),
            "log": str(log),
            "cwd": os.getcwd(),
            "tag": tag,
        }
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as exc:
            self._lost()
            raise ServerGone(f"the fork server exited ({exc})") from None
        return request_id

    # ------------------------------------------------------------------ synchronous use

    def spawn(self, args: Sequence[str], env: Mapping[str, str], log: Path, tag: str) -> int:
        """Fork a child running ``pytest.main(args)``; its pid. Blocking (collection)."""
        request_id = self._request(args, env, log, tag)
        while request_id not in self._started:
            self._receive(None)
        return self._started.pop(request_id)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code, or None if it is still running after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                self._receive(left)
            except ServerGone:
                return self.exits.setdefault(pid, SERVER_DIED)
        return self.exits[pid]

    # ------------------------------------------------------------------ asyncio use

    def attach(self) -> None:
        """Let the running event loop read the socket (the runner calls this first)."""
        self._loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    @property
    def attached(self) -> bool:
        """Whether a running event loop reads the socket (``attach``)."""
        return self._loop is not None

    def detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self._loop = None
        self._start_futures.clear()
        self._exit_futures = {pid: f for pid, f in self._exit_futures.items() if not f.done()}
        for future in self._exit_futures.values():
            future.cancel()
        self._exit_futures.clear()
        if not self._gone:
            self.sock.setblocking(True)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(self.sock.fileno())
            self._lost()
            return
        self._feed(data)

    def exit_future(self, pid: int) -> asyncio.Future[int]:
        future = self._exit_futures.get(pid)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._exit_futures[pid] = future
            if pid in self.exits:
                future.set_result(self.exits[pid])
            elif self._gone:
                future.set_result(self.exits.setdefault(pid, SERVER_DIED))
        return future

    async def start(
        self, args: Sequence[str], env: Mapping[str, str], log: Path, tag: str
    ) -> ForkedProcess:
        """Fork a child for the runner; returns once the server reported its pid."""
        if self._gone:
            raise ServerGone("the fork server exited")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        request_id = self._request(args, env, log, tag)
        self._start_futures[request_id] = future
        if request_id in self._started:  # answered before we registered (cannot happen today)
            future.set_result(self._started.pop(request_id))
        pid = await future
        self._started.pop(request_id, None)
        return ForkedProcess(self, pid)

    # ------------------------------------------------------------------ end

    def close(self, wait: float = 5.0) -> None:
        """Hang up; the server exits. Anything left with its tag (or in its group) is killed.

        ``wait``: seconds the server gets to exit by itself (0: kill it now, as
        when the run ends before it was used).
        """
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        root = self.proc.pid if self.proc.poll() is None else None
        kill_job(root, self.proc.pid, self.placeholder, grace=1.0)
        self.proc.wait()
        shutil.rmtree(self.warm, ignore_errors=True)


def top_level_package(entry: str) -> str:
    """``ray`` for the preload entries ``ray``, ``ray.util`` and ``ray.util:placement_group``."""
    return entry.partition(":")[0].split(".")[0]


def start_server(spec: ServerSpec, launched: ForkServer | None = None) -> Startup:
    """Start a fork server that is safe to fork from, or say why there is none.

    An automatically found module that makes the server unsafe (starts a
    thread, initialises CUDA) is left out, with every other entry of its
    package, and the server started again without them; one the user named,
    or a plugin, means no fork server.
    ``launched`` is a server already started with ``spec`` (``launch(wait=False)``).
    """
    notes: list[str] = []
    auto = list(spec.auto)
    for _ in range(MAX_AUTO_RETRIES + 1):
        try:
            if launched is None:
                server = ForkServer.launch(dataclasses.replace(spec, auto=tuple(auto)))
            else:
                server, launched = launched, None
            hello = server.ready()
        except (ServerGone, OSError) as exc:
            log = spec.log_path
            return Startup(None, f"the fork server did not start ({exc}; see {log})", notes)
        if hello.get("event") == "ready":
            for entry in hello.get("dropped", []):
                notes.append(f"preload: {entry['module']} not preloaded ({entry['reason']})")
            return Startup(server, None, notes)
        server.close()
        module = hello.get("module")
        if hello.get("auto") and module in auto:
            # The package's other entries (``ray.util:x`` after ``ray``) would do the same.
            package = top_level_package(module)
            same = [name for name in auto if top_level_package(name) == package]
            notes.append(f"preload: {', '.join(same)} not preloaded ({hello.get('reason')})")
            auto = [name for name in auto if name not in same]
            continue
        where = f"preload {module!r}" if module else "start-up"
        reason = str(hello.get("reason", "unknown"))
        return Startup(
            None,
            reason if reason.startswith(("preload", "pytest")) else f"{where}: {reason}",
            notes,
        )
    return Startup(None, "too many automatically found preload modules were unsafe", notes)
