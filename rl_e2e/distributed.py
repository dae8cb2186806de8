"""Run a function on N local processes joined in one ``torch.distributed`` group.

Used by tests (and benchmarks) that need real collectives without Ray: each rank
is a fresh process, forked by multiprocessing's fork server from a clean
process that imported torch and ``torch.distributed`` and did nothing else (no
torch operation, no CUDA, no gloo), so no CUDA or gloo state leaks between
runs, and no rank inherits the caller's memory, threads or open files; only
the imports are not repeated.

Failure handling is the point of this module. The caller always gets control
back within ``startup_timeout_s`` plus ``timeout_s``, and what it gets explains
what happened:

- a rank that raises: its traceback, naming the rank, with the tail of every
  other rank's output;
- a rank that dies without a word (``os._exit``, a signal, a segfault): its
  exit code or signal, and its output;
- a hang (the timeout, or the caller interrupted by pytest-timeout or Ctrl-C):
  every live rank's Python stack at that moment, dumped by ``faulthandler``
  armed in each rank, then every rank's whole process tree is killed.

The two timeouts are apart so that a tight one is not flaky: ``timeout_s``
counts from the moment the last rank joined the group, so a rank that never
arrives at a collective is cut ``timeout_s`` into ``fn``, however long the
imports took on a loaded machine; ``startup_timeout_s`` bounds the start-up
itself (starting the processes, imports, the rendezvous).

The rendezvous cannot race with another run on the machine: the caller holds
the ``TCPStore`` on a port the OS gave it (port 0), and the ranks connect to
it; no port is probed and released. Each rank's stdout and stderr go to files
in a log directory (:class:`RankLogs`), which the e2e plugin attaches to the
test's report. A rank dies with its caller, so a caller killed with SIGKILL
leaves neither a rank nor the fork server behind: the server exits as soon as
its caller is gone, and each rank dies with the server (``PR_SET_PDEATHSIG``).

The fork server is multiprocessing's own: one per calling process (all its
contexts, a new one included, use the same), started by the process's first
run, which waits for the server's one import of torch and ``torch.distributed``
(about 1.2 CPU seconds on the 2-core machine; each rank after it then costs
about 0.05 CPU seconds, against 1.3 for one importing torch itself:
``bench/rank_start.py``).
It imports :mod:`rl_e2e.rank_server`, then what :func:`set_rank_preload` names
(nothing by default; the plugin's ``rl_e2e_rank_preload`` ini option sets it),
and nothing else (not the caller's ``__main__``); none of it initialises CUDA,
so a rank may use CUDA (``backend="nccl"``). A process forked from the caller
starts a server of its own. Other code of the caller that uses the fork server
shares it and its preload list; a server that other code started before the
first run still serves the ranks, which then import torch themselves.

A rank runs in the caller's environment, directory and ``sys.path`` as they
are when the run starts, not in the server's; only what torch and the
preloaded modules read once as they are imported (``TORCH_LOGS``, say) keeps
its value of when the server started (``TORCH_DISTRIBUTED_DEBUG`` is read
again). A rank leaves by ``os._exit``, as every child of the server does:
``atexit`` handlers do not run in it (coverage's data is saved before).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, NoReturn

from rl_e2e.coverage import CONFIG_VARIABLE, START_VARIABLE, WorkerCoverage, start_measuring
from rl_e2e.settings import is_module_name
from rl_e2e.source import patched_environ

__all__ = [
    "DistributedRankError",
    "DistributedTimeoutError",
    "RankLogs",
    "rank_preload",
    "run_distributed",
    "set_rank_preload",
]

MASTER_ADDR = "127.0.0.1"
# After a hang: how long the ranks get to write their stacks before SIGKILL.
_STACK_WAIT_S = 2.0
# After a rank failed or finished: how long the others get to exit after SIGTERM.
_TERM_GRACE_S = 2.0
_SAVE_EXIT_S = 30.0  # under coverage: how long ranks that reported get to exit (and save) alone
#: Default bound on start-up: starting the ranks, unpickling ``fn`` and ``args``, the rendezvous.
STARTUP_TIMEOUT_S = 300.0
# The group's own timeout is longer than the run's, so that the caller cuts a hang
# (with every rank's stack) before a waiting rank's collective raises on its own.
_COLLECTIVE_GRACE_S = 30.0
# How much of each rank's output an error message quotes.
_TAIL_LINES = 20
_STACK_SIGNAL = signal.SIGUSR1
# The module the fork server imports first (torch with it): see rl_e2e/rank_server.py.
_SERVER_PRELOAD = "rl_e2e.rank_server"
# What else it imports after that: set_rank_preload.
_rank_preload: tuple[str, ...] = ()
_PR_SET_PDEATHSIG = 1


class DistributedRankError(RuntimeError):
    """A rank of :func:`run_distributed` raised or died.

    ``rank`` is the failing rank; ``remote_traceback`` is its formatted
    traceback (empty when the process died without raising); ``exitcode`` is
    set when the process ended without reporting a result.
    """

    def __init__(
        self, rank: int, message: str, remote_traceback: str = "", exitcode: int | None = None
    ) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        text = f"rank {rank} {message}"
        if remote_traceback:
            text += f"\n\nRemote traceback (rank {rank}):\n{remote_traceback}"
        super().__init__(text)

    def __reduce__(self):  # keep the exception picklable with its fields
        return (
            _rebuild_rank_error,
            (self.rank, self.args[0], self.remote_traceback, self.exitcode),
        )


def _rebuild_rank_error(
    rank: int, text: str, remote_traceback: str, exitcode: int | None
) -> DistributedRankError:
    err = DistributedRankError.__new__(DistributedRankError)
    RuntimeError.__init__(err, text)
    err.rank, err.remote_traceback, err.exitcode = rank, remote_traceback, exitcode
    return err


class DistributedTimeoutError(TimeoutError):
    """:func:`run_distributed` did not finish within its timeout.

    ``pending`` lists the ranks that had not returned; ``stacks`` maps each of
    them to the Python stack it dumped when the timeout fired. ``not_joined``
    is empty when the run timed out (``timeout_s`` after every rank joined),
    and lists the ranks that had not joined the group when start-up did
    (``startup_timeout_s`` after the start).
    """

    def __init__(
        self,
        timeout_s: float,
        pending: list[int],
        stacks: dict[int, str] | None = None,
        not_joined: list[int] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.pending = pending
        self.stacks = dict(stacks or {})
        self.not_joined = list(not_joined or [])
        if self.not_joined:
            text = (
                f"run_distributed: ranks {self.not_joined} did not join the process group "
                f"within {timeout_s:g} s of the start (startup_timeout_s); ranks still "
                f"running: {pending}"
            )
        else:
            text = (
                f"run_distributed timed out after {timeout_s:g} s; ranks still running: {pending}"
            )
        for rank in pending:
            stack = self.stacks.get(rank, "").strip() or (
                "(no stack: the rank had not started running fn yet)"
            )
            text += f"\n\nStack of rank {rank} at the timeout:\n{stack}"
        super().__init__(text)

    def __reduce__(self):
        return (
            DistributedTimeoutError,
            (self.timeout_s, self.pending, self.stacks, self.not_joined),
        )


@dataclass
class RankLogs:
    """Where the ranks of one run write: ``rank<r>.out``, ``.err``, ``.stack``, NCCL's logs.

    ``stacks_taken`` is set when the ranks were asked for their stacks (a hang).
    """

    directory: Path
    world_size: int
    backend: str
    stacks_taken: bool = False
    failed: bool = False

    def path(self, rank: int, kind: str) -> Path:
        """The file of ``rank`` for ``kind`` (``out``, ``err`` or ``stack``)."""
        return self.directory / f"rank{rank}.{kind}"

    def nccl_logs(self, rank: int) -> list[Path]:
        """NCCL's own log files of ``rank`` (only where ``NCCL_DEBUG`` was set)."""
        return sorted(self.directory.glob(f"nccl.rank{rank}.*.log"))

    def read(self, rank: int, kind: str, max_bytes: int) -> str:
        """The last ``max_bytes`` of a rank's file ("" when it is missing)."""
        return tail_text(self.path(rank, kind), max_bytes)

    def sections(self, max_bytes: int) -> list[tuple[str, str]]:
        """Report sections ``(key, text)``, one per non-empty file, each at most ``max_bytes``.

        Keys start with ``stdout`` or ``stderr`` (``stderr rank 1 stack at the
        timeout``): pytest titles a section added with ``add_report_section``
        ``Captured <key> <phase>``, and its JUnit writer files ``Captured stdout``
        / ``Captured stderr`` sections under ``system-out`` / ``system-err``.
        """
        found = []
        for rank in range(self.world_size):
            for kind, name in (("out", "stdout"), ("err", "stderr")):
                text = self.read(rank, kind, max_bytes)
                if text.strip():
                    found.append((f"{name} rank {rank}", text))
            stack = self.read(rank, "stack", max_bytes)
            if stack.strip():
                found.append((f"stderr rank {rank} stack at the timeout", stack))
            for log in self.nccl_logs(rank):
                text = tail_text(log, max_bytes)
                if text.strip():
                    found.append((f"stderr rank {rank} {log.name}", text))
        return found

    def tails(self, ranks: list[int], lines: int = _TAIL_LINES) -> str:
        """The last lines of the listed ranks' stderr and stdout, for an error message."""
        parts = []
        for rank in ranks:
            for kind in ("err", "out"):
                text = self.read(rank, kind, 64 * 1024).rstrip()
                if text:
                    last = "\n".join(text.splitlines()[-lines:])
                    parts.append(f"--- rank {rank} std{kind} (last {lines} lines) ---\n{last}")
        return "\n".join(parts)


def tail_text(path: Path, max_bytes: int) -> str:
    """The last ``max_bytes`` of ``path`` as text, marked when cut; "" when missing."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            handle.seek(max(0, size - max_bytes))
            data = handle.read(max_bytes)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if size > max_bytes:
        text = f"[... first {size - max_bytes} bytes left out ...]\n" + text
    return text


@dataclass(frozen=True)
class _Outcome:
    """What a rank sends back: its return value, or its exception."""

    rank: int
    ok: bool
    payload: bytes  # pickled return value, or pickled exception (b"" if unpicklable)
    error_text: str = ""  # "ValueError: message" when not ok
    remote_traceback: str = ""
    failed_at: float = 0.0  # time.time() of the failure, to find the first one


@dataclass(frozen=True)
class _Joined:
    """What a rank sends once it is in the group, before it runs ``fn``."""

    rank: int


class _Call:
    """``fn`` and ``args`` on their way to a rank, which unpickles them itself (:class:`_Packed`).

    Pickled inside the pickling of the rank's process, by multiprocessing's
    pickler, so torch's reductions still send argument tensors as shared
    memory (their file descriptors travel with the rank's, at most about 250 of
    them); unpickled by the rank once its output goes to its files, so a
    module that fails to import there is that rank's error, with its traceback.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[type[_Packed], tuple[bytes]]:
        return (_Packed, (bytes(ForkingPickler.dumps((self.fn, self.args))),))


@dataclass(frozen=True)
class _Packed:
    """A :class:`_Call` as the rank receives it."""

    data: bytes

    def unpack(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return ForkingPickler.loads(self.data)


def _die_with_caller(server_pid: int) -> None:
    """Make this rank die with its caller, though its parent is the fork server.

    The server exits when the last copy of the write end of its "alive" pipe
    is closed: the caller holds one, and every process the server forks
    inherits one. So the rank asks Linux to SIGKILL it when the server exits
    (``PR_SET_PDEATHSIG``), then closes its copy: a caller killed with SIGKILL
    takes the server with it, and the server its ranks. The server cannot have
    exited before the ``prctl``, since this rank still held a copy; one killed
    from outside meanwhile has the rank leave at once. Off Linux, only the copy
    is closed.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server_pid:
            os._exit(1)
    _forget_fork_server()


def _forget_fork_server() -> None:
    """Drop what this process inherited of another process's fork server (its "alive" pipe).

    Run in each rank, and in any process forked from a process that imported
    this module (``os.register_at_fork``): the fork server belongs to the
    process that started it, so a forked child that kept its pid would fail
    to wait for it (``ChildProcessError``) at its first run, instead of
    starting a server of its own, and its copy of the pipe would keep the
    server, and so the ranks, alive after their caller died. Imports nothing.
    """
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:  # no fork server was ever started or used here
        return
    server = forkserver._forkserver  # no public API: the stdlib keeps it in a module global
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None


os.register_at_fork(after_in_child=_forget_fork_server)


def _measure_rank() -> Any:
    """Start coverage if the caller's environment asks for it; the started ``Coverage``, or None.

    What coverage's ``.pth`` file does as a Python process starts, which a
    forked rank does not do: the fork server is started unmeasured
    (:func:`_fork_server`), and the rank takes the caller's environment after
    the fork. Imports nothing when coverage is off.
    """
    if not (os.environ.get(CONFIG_VARIABLE) or os.environ.get(START_VARIABLE)):
        return None
    import coverage

    return coverage.process_startup()


def _redirect_output(logs: RankLogs, rank: int) -> None:
    """Send this process's fds 1 and 2 to the rank's files; arm faulthandler."""
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(logs.path(rank, kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives with the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # A fatal signal (segfault, abort) prints the stack to stderr; the caller's
    # signal prints it to the stack file.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    stack_file = open(logs.path(rank, "stack"), "w")  # noqa: SIM115 - faulthandler keeps it
    faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    startup_timeout_s: float,
    conn: Connection,
    logs: RankLogs,
    server_pid: int,
    environ: dict[str, str],
    call: _Packed,
) -> None:
    """Body of one rank, forked by the fork server: join the group, run ``fn``, report, leave.

    The outcome is sent (synchronously) before the group is destroyed: peers
    only see connection errors after the real cause is on its way to the caller.
    """
    _die_with_caller(server_pid)
    # The caller's environment as the run started; the server's dates from its own start.
    os.environ.clear()
    os.environ.update(environ)
    _redirect_output(logs, rank)
    measured = _measure_rank()
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if os.environ.get("NCCL_DEBUG", "").strip():
        # %p: NCCL puts the pid in the name; one file per process of this rank.
        os.environ["NCCL_DEBUG_FILE"] = str(logs.directory / f"nccl.rank{rank}.%p.log")
    import torch
    import torch.distributed as dist

    dist.set_debug_level_from_env()  # read as the server imported torch.distributed, in its env
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: ranks sharing a host must not each spin a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            fn, args = call.unpack()
            store = dist.TCPStore(
                MASTER_ADDR,
                port,
                is_master=False,
                timeout=timedelta(seconds=startup_timeout_s + timeout_s),
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s + _COLLECTIVE_GRACE_S),
            )
            if backend == "gloo":
                # Every rank connected before any runs fn: one whose fn returns at once
                # would close its connections while a peer still reads on its own, and
                # gloo fails that peer's join ("Connection closed by peer").
                dist.barrier()
            conn.send(_Joined(rank))
            outcome = _Outcome(rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            outcome = _failure(rank, exc)
            traceback.print_exc()  # into the rank's stderr file too
        conn.send(outcome)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
        if measured is not None:  # the rank leaves by os._exit, past coverage's exit handler
            measured.stop()
            measured.save()


def _failure(rank: int, exc: BaseException) -> _Outcome:
    try:
        payload = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - unpicklable exception: its text is enough
        payload = b""
    return _Outcome(
        rank,
        False,
        payload,
        error_text=f"{type(exc).__name__}: {exc}",
        remote_traceback=traceback.format_exc(),
        failed_at=time.time(),
    )


def check_arguments(
    fn: Callable[..., Any],
    world_size: object,
    backend: str,
    timeout_s: object,
    startup_timeout_s: object = STARTUP_TIMEOUT_S,
) -> None:
    """Refuse bad arguments before any rank starts, naming the argument.

    Raises:
        ValueError: ``world_size`` not an int >= 1, ``timeout_s`` not > 0, an
            unknown backend, or NCCL with fewer visible cards than ranks.
        TypeError: ``fn`` cannot be pickled into a rank.
    """
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if not (isinstance(startup_timeout_s, int | float) and startup_timeout_s > 0):
        raise ValueError(f"startup_timeout_s must be a number > 0, got {startup_timeout_s!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend 'nccl' with world_size={world_size} needs {world_size} CUDA devices, "
                f"{torch.cuda.device_count()} visible"
            )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn must be picklable (a module-level function) to run in the ranks; got {fn!r}: {exc}"
        ) from exc


def _trees(processes: list[Any]) -> list[Any]:
    """Every live process of the ranks: each rank and everything it started."""
    import psutil

    found = []
    for proc in processes:
        if proc.pid is None:
            continue
        try:
            root = psutil.Process(proc.pid)
            found += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def _join_all(processes: list[Any], bound_s: float) -> None:
    """Wait until every rank has exited, or ``bound_s`` has passed."""
    deadline = time.monotonic() + bound_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))


def _kill_trees(processes: list[Any], grace_s: float) -> None:
    """TERM (then, after ``grace_s``, KILL) every rank's whole tree; reap the ranks."""
    import psutil

    tree = _trees(processes)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    _, alive = psutil.wait_procs(tree, timeout=grace_s) if grace_s > 0 else ([], tree)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    for proc in processes:
        if proc.pid is not None:
            proc.join(5)
        with contextlib.suppress(ValueError):
            proc.close()


def _take_stacks(processes: list[Any], ranks: list[int], logs: RankLogs) -> dict[int, str]:
    """Ask each listed rank for its Python stack; wait until the files stop growing."""
    logs.stacks_taken = True
    for rank in ranks:
        if processes[rank].is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(processes[rank].pid, _STACK_SIGNAL)
    deadline = time.monotonic() + _STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = {rank: _size(logs.path(rank, "stack")) for rank in ranks}
        if all(now[r] > 0 for r in ranks) and now == sizes:
            break
        sizes = now
    return {rank: logs.read(rank, "stack", 256 * 1024) for rank in ranks}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _raise_for(outcome: _Outcome, logs: RankLogs) -> NoReturn:
    """Re-raise a rank's failure on the caller, chained to its original exception."""
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    original: BaseException | None = None
    if outcome.payload:
        try:
            original = pickle.loads(outcome.payload)
        except Exception:  # noqa: BLE001 - the text already says what happened
            original = None
    others = [r for r in range(logs.world_size) if r != outcome.rank]
    text = f"raised {outcome.error_text}"
    traceback_text = outcome.remote_traceback
    tails = logs.tails(others)
    if tails:
        traceback_text += f"\nOutput of the other ranks:\n{tails}"
    raise DistributedRankError(outcome.rank, text, traceback_text) from original


def _died(rank: int, exitcode: int | None, logs: RankLogs) -> NoReturn:
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    tails = logs.tails(list(range(logs.world_size)))
    raise DistributedRankError(
        rank,
        f"{how} without returning a result" + (f"\n\n{tails}" if tails else ""),
        exitcode=exitcode,
    )


@contextlib.contextmanager
def _log_directory(log_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """``log_dir`` (kept), or a temporary directory removed afterwards."""
    if log_dir is not None:
        kept = Path(log_dir)
        kept.mkdir(parents=True, exist_ok=True)
        yield kept
        return
    path = Path(tempfile.mkdtemp(prefix="ranks-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _merged(measuring: WorkerCoverage | None) -> Iterator[None]:
    """Merge what the ranks measured once they are gone (nothing with coverage off)."""
    try:
        yield
    finally:
        if measuring is not None:
            measuring.merge()


@dataclass
class _Run:
    started: float = field(default_factory=time.monotonic)
    processes: list[Any] = field(default_factory=list)
    readers: dict[Connection, int] = field(default_factory=dict)
    values: dict[int, Any] = field(default_factory=dict)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120,
    log_dir: str | os.PathLike[str] | None = None,
    on_logs: Callable[[RankLogs], None] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (the ranks).

    Each rank runs inside an initialised default process group (``backend``:
    ``"gloo"``, or ``"nccl"`` with ``cuda:rank``) whose store the caller holds;
    ``MASTER_ADDR``, ``MASTER_PORT`` (the store's), ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` are set for code that reads them. The group is destroyed
    whether ``fn`` returns or raises. Unless ``OMP_NUM_THREADS`` is set, each rank
    uses cpu_count // world_size intra-op threads (at least 1).

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function) and so
    must the return values, which come back as a list indexed by rank.

    While coverage measures the caller, each rank is measured from its start
    under the caller's configuration, and its data merged beside the caller's
    data file when the ranks are gone (:mod:`rl_e2e.coverage`); a rank killed
    after a failure or a timeout keeps nothing.

    Each rank's output goes to ``log_dir`` (default: a temporary directory,
    removed at the end); ``on_logs`` is called with the :class:`RankLogs` before
    the ranks start, so a caller can attach them to a report whatever happens.

    Raises:
        DistributedRankError: the first rank that raised (message and remote
            traceback, chained to the original exception when it unpickles,
            with the other ranks' output), or a rank that exited without
            reporting (with its exit code). A rank that dies silently is blamed
            before ranks that raised at the same moment, since their errors are
            usually its consequence. All other ranks are killed.
        DistributedTimeoutError: not every rank finished within ``timeout_s``
            seconds of the moment the last rank joined the group, or not every
            rank joined within ``startup_timeout_s`` seconds of the start
            (``not_joined`` names those); it carries the stack of every rank
            still running, and every rank is killed.
        ValueError, TypeError: bad arguments, before any rank starts.
    """
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    check_arguments(fn, world_size, backend, timeout_s, startup_timeout_s)
    import torch.distributed as dist
    import torch.multiprocessing  # noqa: F401 - torch's reductions: argument tensors go as shared memory

    context, server_pid = _fork_server()
    measuring = start_measuring()
    environ = {**os.environ, **(measuring.env if measuring else {})}
    with _log_directory(log_dir) as directory, _merged(measuring):
        logs = RankLogs(directory, world_size, backend)
        if on_logs is not None:
            on_logs(logs)
        # Port 0: the OS gives the store a port nobody else holds, and it is held
        # until the run ends, so two runs on one machine can never meet.
        store = dist.TCPStore(
            MASTER_ADDR,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=startup_timeout_s + timeout_s),
        )
        run = _Run()
        finished = False
        try:
            with _bounded_start(server_pid, startup_timeout_s, world_size):
                for rank in range(world_size):
                    reader, writer = context.Pipe(duplex=False)
                    proc = context.Process(
                        target=_rank_main,
                        args=(
                            rank,
                            world_size,
                            store.port,
                            backend,
                            timeout_s,
                            startup_timeout_s,
                            writer,
                            logs,
                            server_pid,
                            environ,
                            _Call(fn, args),
                        ),  # fmt: skip
                        name=f"run_distributed-rank{rank}",
                        daemon=True,
                    )
                    run.processes.append(proc)
                    proc.start()
                    writer.close()  # the rank holds the only write end: EOF when it dies
                    run.readers[reader] = rank
            result = _collect(run, logs, timeout_s, startup_timeout_s)
            finished = True
            return result
        except (DistributedTimeoutError, DistributedRankError):
            logs.failed = True  # explained already: its stacks, or the rank that failed
            raise
        except BaseException:
            logs.failed = True
            # Interrupted from outside (pytest-timeout, Ctrl-C): the same
            # explanation as a timeout, in the rank files the report attaches.
            pending = [r for r in range(world_size) if r not in run.values]
            live = [r for r in pending if r < len(run.processes) and run.processes[r].is_alive()]
            if live:
                _take_stacks(run.processes, live, logs)
            raise
        finally:
            for reader in run.readers:
                reader.close()
            if finished and measuring is not None:
                # A rank saves what it measured as it exits, which it does once it has
                # reported: a TERM in the middle of that save would cut the data file short.
                _join_all(run.processes, _SAVE_EXIT_S)
            _kill_trees(run.processes, _TERM_GRACE_S if finished else 0)
            del store


def set_rank_preload(modules: Sequence[str]) -> None:
    """Name the modules the ranks' fork server imports, after torch, before it forks any rank.

    Each rank then finds them imported instead of importing them itself: the
    cost of a rank that runs a trainer's code (tensordict, transformers'
    models and tokenizers, FSDP, DCP: about 3 CPU seconds) is paid once per
    calling process. Name third-party modules only: the server's imports run
    before any rank measures coverage, so the module-level lines of a package
    of your own imported there would go unmeasured in the ranks. A named
    module must not initialise CUDA as it is imported, nor start a thread a
    rank would need (the ranks are forked from the server, which copies no
    thread; OpenBLAS's pool, which numpy starts, is made again after a fork). One
    that fails to import is left to the ranks, which then raise on their own
    import of it. The list replaces the previous one and takes effect when the
    server starts: at the first run of the process, or after a run killed it.

    Raises:
        ValueError: an entry that is not a dotted module name.
    """
    global _rank_preload
    names = tuple(modules)
    for name in names:
        if not is_module_name(name):
            raise ValueError(f"set_rank_preload: {name!r} is not a module name (package.module)")
    _rank_preload = names


def rank_preload() -> tuple[str, ...]:
    """The modules a fork server started now would import after torch (see :func:`set_rank_preload`)."""
    return _rank_preload


def _fork_server() -> tuple[BaseContext, int]:
    """multiprocessing's fork server of this process, started now unless it runs; and its pid.

    One per process: multiprocessing keeps it in a module global, and its
    contexts (``get_context("forkserver")`` and any new one) all use that one.
    It is started with :data:`_SERVER_PRELOAD` and then :func:`rank_preload` to import, and without
    coverage's start-up variables: a measured server would pass a running
    tracer, with the server's data file, to every rank it forks (a rank starts
    its own, :func:`_measure_rank`). Returns at once: the server imports as the
    first rank waits for it (:func:`_bounded_start`).
    """
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([_SERVER_PRELOAD, *_rank_preload])
    with patched_environ({START_VARIABLE: None, CONFIG_VARIABLE: None}):
        forkserver.ensure_running()
    return context, forkserver._forkserver._forkserver_pid  # no public API gives the pid


@contextlib.contextmanager
def _bounded_start(server_pid: int, bound_s: float, world_size: int) -> Iterator[None]:
    """Bound the ranks' start by ``bound_s``, killing a fork server that has not forked them.

    Starting a rank waits until the server has forked it, which a newly started
    server does once it has imported torch. One that has not forked every rank
    by the bound (an import that hangs) is killed, and the start fails with a
    :class:`DistributedTimeoutError` naming every rank as not joined (any rank
    it forked dies with it); the next run starts a new server.
    """
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    cut = threading.Event()

    def kill_server() -> None:
        cut.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)

    watchdog = threading.Timer(bound_s, kill_server)
    watchdog.daemon = True
    watchdog.start()
    ranks = list(range(world_size))
    try:
        yield
    except (OSError, EOFError) as exc:  # the server's pipes closed under a waiting start
        if not cut.is_set():
            raise
        raise _not_started(bound_s, ranks, server_pid) from exc
    finally:
        watchdog.cancel()
    if cut.is_set():
        raise _not_started(bound_s, ranks, server_pid)


def _not_started(bound_s: float, ranks: list[int], server_pid: int) -> DistributedTimeoutError:
    err = DistributedTimeoutError(bound_s, ranks, {}, ranks)
    err.add_note(
        f"The fork server (pid {server_pid}) had not started every rank by then (still "
        "importing torch?); it was killed, and the next run starts a new one."
    )
    return err


def _collect(run: _Run, logs: RankLogs, timeout_s: float, startup_timeout_s: float) -> list[Any]:
    """Wait for every rank's outcome; raise for the first failure, a death or a timeout.

    Until every rank has joined the group the deadline is ``startup_timeout_s``
    after the start; from then on it is ``timeout_s`` after the last rank joined.
    """
    __tracebackhide__ = True  # pytest shows the caller, not these frames
    world_size = len(run.processes)
    joined: set[int] = set()
    deadline = run.started + startup_timeout_s
    while len(run.values) < world_size:
        remaining = deadline - time.monotonic()
        pending = [r for r in range(world_size) if r not in run.values]
        if remaining <= 0:
            live = [r for r in pending if run.processes[r].is_alive()]
            stacks = _take_stacks(run.processes, live, logs)
            if len(joined) < world_size:
                not_joined = [r for r in range(world_size) if r not in joined]
                raise DistributedTimeoutError(startup_timeout_s, pending, stacks, not_joined)
            raise DistributedTimeoutError(timeout_s, pending, stacks)
        ready = wait(list(run.readers), timeout=remaining)
        failures: list[_Outcome] = []
        dead: list[int] = []
        for reader in ready:
            rank = run.readers[reader]
            try:
                message = reader.recv()
            except EOFError:
                dead.append(rank)
                del run.readers[reader]
                reader.close()
                continue
            if isinstance(message, _Joined):
                joined.add(rank)
                if len(joined) == world_size:
                    deadline = time.monotonic() + timeout_s
                continue
            del run.readers[reader]
            reader.close()
            if message.ok:
                run.values[rank] = pickle.loads(message.payload)
            else:
                failures.append(message)
        if dead:
            run.processes[dead[0]].join(_TERM_GRACE_S)
            _died(dead[0], run.processes[dead[0]].exitcode, logs)
        if failures:
            _raise_for(min(failures, key=lambda o: o.failed_at), logs)
    return [run.values[rank] for rank in range(world_size)]
