"""Run a function on N local processes joined in one ``torch.distributed`` group.

Used by tests (and benchmarks) that need real collectives without Ray: each rank
is a fresh ``spawn`` process, so CUDA and gloo state never leak between runs.

Failure handling is the point of this module. The caller always gets control
back within ``timeout_s``: a rank that raises, a rank that dies without a word
(``os._exit``, a signal, a segfault), and a rank stuck in a collective whose
peer is gone all end the run, kill every remaining rank, and raise on the
caller naming the rank that failed first.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "DistributedRankError",
    "DistributedTimeoutError",
    "default_backend",
    "free_port",
    "run_distributed",
]

MASTER_ADDR = "127.0.0.1"
# After SIGTERM, how long a rank gets to exit before SIGKILL.
_TERM_GRACE_S = 2.0


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
    """:func:`run_distributed` did not finish within its timeout; ``pending`` lists
    the ranks that had not returned."""

    def __init__(self, timeout_s: float, pending: list[int]) -> None:
        self.timeout_s = timeout_s
        self.pending = pending
        super().__init__(
            f"run_distributed timed out after {timeout_s:g} s; ranks still running: {pending}"
        )


def free_port(host: str = MASTER_ADDR) -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The OS picks it (bind to port 0), so it never collides with a listening
    socket; another process may still take it before the caller binds it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class _Outcome:
    """What a rank sends back: its return value, or its exception."""

    rank: int
    ok: bool
    payload: bytes  # pickled return value, or pickled exception (b"" if unpicklable)
    error_text: str = ""  # "ValueError: message" when not ok
    remote_traceback: str = ""
    failed_at: float = 0.0  # time.time() of the failure, to find the first one


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, report, leave the group.

    The outcome is sent (synchronously) before the group is destroyed: peers
    only see connection errors after the real cause is on its way to the caller.
    """
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: ranks sharing a host must not each spin a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(
                backend,
                init_method=f"tcp://{MASTER_ADDR}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            outcome = _Outcome(rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            outcome = _failure(rank, exc)
        conn.send(outcome)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


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


def _check_arguments(
    fn: Callable[..., Any], world_size: int, backend: str, timeout_s: float
) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend 'nccl' with world_size={world_size} needs {world_size} CUDA devices, "
            f"{torch.cuda.device_count()} visible"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn must be picklable (a module-level function) to run in spawned processes; "
            f"got {fn!r}: {exc}"
        ) from exc


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill, every rank still alive; reap them all."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
        proc.join()
        proc.close()


def _raise_for(outcome: _Outcome) -> NoReturn:
    """Re-raise a rank's failure on the caller, chained to its original exception."""
    original: BaseException | None = None
    if outcome.payload:
        try:
            original = pickle.loads(outcome.payload)
        except Exception:  # noqa: BLE001 - the text already says what happened
            original = None
    raise DistributedRankError(
        outcome.rank, f"raised {outcome.error_text}", outcome.remote_traceback
    ) from original


def _died(rank: int, exitcode: int | None) -> NoReturn:
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    raise DistributedRankError(rank, f"{how} without returning a result", exitcode=exitcode)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 120,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Each rank runs inside an initialised default process group (``backend``,
    default :func:`default_backend`; NCCL ranks use ``cuda:rank``) rendezvousing
    at ``127.0.0.1`` on a free port; ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` are set for code that reads them. The group is
    destroyed whether ``fn`` returns or raises. Unless ``OMP_NUM_THREADS`` is set,
    each rank uses cpu_count // world_size intra-op threads (at least 1).

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function) and so
    must the return values, which come back as a list indexed by rank.

    Raises:
        DistributedRankError: the first rank that raised (message and remote
            traceback, chained to the original exception when it unpickles), or
            a rank that exited without reporting (with its exit code). A rank
            that dies silently is blamed before ranks that raised at the same
            moment, since their errors are usually its consequence. All other
            ranks are killed.
        DistributedTimeoutError: not every rank finished within ``timeout_s``
            seconds (start-up included); every rank is killed.
    """
    backend = backend or default_backend()
    _check_arguments(fn, world_size, backend, timeout_s)
    ctx = mp.get_context("spawn")
    port = free_port()
    processes: list[Any] = []
    readers: dict[Connection, int] = {}
    values: dict[int, Any] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, backend, timeout_s, writer, fn, args),
                name=f"run_distributed-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only write end: EOF when it dies
            processes.append(proc)
            readers[reader] = rank
        deadline = time.monotonic() + timeout_s
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            pending = [r for r in range(world_size) if r not in values]
            if remaining <= 0:
                raise DistributedTimeoutError(timeout_s, pending)
            ready = wait(list(readers), timeout=remaining)
            failures: list[_Outcome] = []
            dead: list[int] = []
            for reader in ready:
                rank = readers.pop(reader)
                try:
                    outcome: _Outcome = reader.recv()
                except EOFError:
                    dead.append(rank)
                    continue
                finally:
                    reader.close()
                if outcome.ok:
                    values[rank] = pickle.loads(outcome.payload)
                else:
                    failures.append(outcome)
            if dead:
                processes[dead[0]].join(_TERM_GRACE_S)
                _died(dead[0], processes[dead[0]].exitcode)
            if failures:
                _raise_for(min(failures, key=lambda o: o.failed_at))
        return [values[rank] for rank in range(world_size)]
    finally:
        for reader in readers:
            reader.close()
        _stop(processes)
