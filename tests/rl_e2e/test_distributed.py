"""Tests of rl_e2e.distributed on real processes (forked by the fork server) and real gloo groups."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from deadlines import hang_guard

from rl_e2e.distributed import (
    DistributedRankError,
    DistributedTimeoutError,
    RankLogs,
    run_distributed,
)

# --- functions run on the ranks (module level: they are pickled by name) ---


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> dict:
    """All-reduce each rank's id, and report what the rank saw of its setup."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "backend": dist.get_backend(),
        "sum": t.item() * scale,
        "env": (os.environ["MASTER_ADDR"], os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "tensor": torch.full((2,), float(rank)),
        "pid": os.getpid(),
    }


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # rank 0 waits on a peer that never arrives


def _rank_one_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.barrier()


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _sleep_briefly(rank: int, world_size: int, pause_s: float) -> int:
    time.sleep(pause_s)
    return rank


def _after_sleeping(seconds: float, value: float) -> float:
    time.sleep(seconds)
    return value


def _raise_import_error(name: str) -> None:
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


class _FailsToUnpickle:
    """Unpickles by raising, as an argument whose module the ranks cannot import does."""

    def __reduce__(self):
        return (_raise_import_error, ("gone_from_the_ranks",))


def _environ_seen(rank: int, world_size: int, name: str) -> tuple[str | None, str, int]:
    return os.environ.get(name), str(dist.get_debug_level()), os.getppid()


class _SlowToUnpickle:
    """Unpickles to ``value`` after ``seconds``: a slow start-up, in the rank before it joins."""

    def __init__(self, seconds: float, value: float) -> None:
        self.seconds, self.value = seconds, value

    def __reduce__(self):
        return (_after_sleeping, (self.seconds, self.value))


def _children_of_this_process() -> list[psutil.Process]:
    """Live descendants, except multiprocessing's resource tracker and fork server (one of
    each per parent process, started by the first run and kept by design). The ranks the
    server forked are listed: they show the server's command line, but not this parent."""
    me = psutil.Process()
    out = []
    for proc in me.children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
            server = "multiprocessing.forkserver" in command and proc.ppid() == me.pid
            if "multiprocessing.resource_tracker" not in command and not server:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


# --- tests ---


def test_returns_each_ranks_value_in_rank_order() -> None:
    out = run_distributed(_sum_of_ranks, 2, 10.0, backend="gloo", timeout_s=hang_guard(60))
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["dist_rank"] for o in out] == [0, 1]
    assert all(o["world_size"] == 2 and o["backend"] == "gloo" for o in out)
    assert [o["sum"] for o in out] == [10.0, 10.0]  # (0 + 1) * 10 on both ranks
    assert [o["env"] for o in out] == [("127.0.0.1", "0", "2"), ("127.0.0.1", "1", "2")]
    assert torch.equal(out[1]["tensor"], torch.tensor([1.0, 1.0]))
    assert len({out[0]["pid"], out[1]["pid"], os.getpid()}) == 3  # two fresh processes
    assert _children_of_this_process() == []


def test_exception_on_rank_one_names_rank_one_with_remote_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_rank_one_raises, 2, backend="gloo", timeout_s=hang_guard(60))
    err = info.value
    assert err.rank == 1
    assert "rank 1 raised ValueError: boom from the second rank" in str(err)
    assert "_rank_one_raises" in err.remote_traceback  # the frame that raised, remotely
    assert isinstance(err.__cause__, ValueError)
    assert time.monotonic() - start < 50  # returned on the failure, not on the timeout
    assert _children_of_this_process() == []


def test_rank_that_exits_silently_does_not_hang_the_caller() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_rank_one_exits, 2, backend="gloo", timeout_s=hang_guard(60))
    assert info.value.rank == 1
    assert info.value.exitcode == 7
    assert "rank 1 exited with code 7 without returning a result" in str(info.value)
    assert time.monotonic() - start < 50
    assert _children_of_this_process() == []


def test_timeout_kills_every_rank() -> None:
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_sleep_forever, 1, backend="gloo", timeout_s=2)
    assert info.value.pending == [0]
    assert "timed out after 2 s" in str(info.value)
    assert _children_of_this_process() == []


def test_the_timeout_counts_from_the_moment_every_rank_joined() -> None:
    """A start-up longer than ``timeout_s`` (4 s of unpickling) does not eat into it."""
    start = time.monotonic()
    out = run_distributed(_sleep_briefly, 2, _SlowToUnpickle(4.0, 0.5), timeout_s=3)
    assert out == [0, 1]
    assert time.monotonic() - start > 4
    assert _children_of_this_process() == []


def test_a_start_up_past_its_bound_names_the_ranks_that_never_joined() -> None:
    """With each rank's stack where its start-up hangs: here, unpickling an argument."""
    run_distributed(_sleep_briefly, 2, 0.0, timeout_s=hang_guard(60))  # the fork server is up
    bound = hang_guard(2)  # each rank forked and at its argument; 1 s was short at load 17
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_sleep_briefly, 2, _SlowToUnpickle(3600, 0.5), startup_timeout_s=bound)
    err = info.value
    assert err.not_joined == [0, 1] and err.pending == [0, 1]
    assert f"ranks [0, 1] did not join the process group within {bound:g} s of the start" in str(
        err
    )
    assert all("_after_sleeping" in err.stacks[rank] for rank in (0, 1)), err.stacks
    assert _children_of_this_process() == []


def test_an_argument_that_fails_to_unpickle_is_the_ranks_error_with_its_traceback() -> None:
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_sleep_briefly, 2, _FailsToUnpickle(), timeout_s=hang_guard(60))
    err = info.value
    assert f"rank {err.rank} raised ModuleNotFoundError: No module named 'gone_from_the_ranks'" in (
        str(err)
    )
    assert "_raise_import_error" in err.remote_traceback
    assert _children_of_this_process() == []


def test_ranks_run_in_the_callers_environment_of_the_moment(monkeypatch) -> None:
    """Not the fork server's, which dates from its start; one server forks every rank."""
    first = run_distributed(_environ_seen, 2, "RL_E2E_PROBE", timeout_s=hang_guard(60))
    monkeypatch.setenv("RL_E2E_PROBE", "set after the server started")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")  # which torch reads as it is imported
    second = run_distributed(_environ_seen, 2, "RL_E2E_PROBE", timeout_s=hang_guard(60))
    assert [value for value, _, _ in second] == ["set after the server started"] * 2
    assert [level for _, level, _ in second] == ["DebugLevel.INFO"] * 2
    parents = {parent for _, _, parent in first + second}
    assert len(parents) == 1 and os.getpid() not in parents


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s must be a number > 0, got 0"),
        (
            {"world_size": 2, "startup_timeout_s": -1},
            "startup_timeout_s must be a number > 0, got -1",
        ),
        ({"world_size": 2, "backend": "mpi"}, "backend must be 'gloo' or 'nccl', got 'mpi'"),
    ],
)
def test_bad_arguments_are_refused_before_spawning(kwargs: dict, message: str) -> None:
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        run_distributed(_sum_of_ranks, world_size, 1.0, **kwargs)


def test_unpicklable_function_is_refused() -> None:
    with pytest.raises(TypeError, match="fn must be picklable"):
        run_distributed(lambda rank, ws: rank, 2, backend="gloo")


def _talk_then_sleep_on_rank_one(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}", flush=True)
    print(f"warning from rank {rank}", file=sys.stderr, flush=True)
    if rank == 1:
        _stuck_in_a_named_frame()
    dist.barrier()  # rank 0 waits for rank 1 here


def _stuck_in_a_named_frame() -> None:
    time.sleep(3600)


def _talk_then_raise_on_rank_zero(rank: int, world_size: int) -> None:
    print(f"rank {rank} got this far", flush=True)
    dist.barrier()  # both have printed
    if rank == 0:
        raise RuntimeError("rank zero gives up")
    dist.barrier()


def _store_port(rank: int, world_size: int) -> int:
    dist.barrier()
    return int(os.environ["MASTER_PORT"])


def test_a_hang_explains_itself_with_every_ranks_stack(tmp_path: Path) -> None:
    """The timeout dumps each live rank's stack, labelled, then kills them all.

    How soon the error follows the timeout is a figure of bench/e2e_fixtures.py.
    """
    seen: list[RankLogs] = []
    with pytest.raises(DistributedTimeoutError) as info:
        # Long enough for both ranks to start on a loaded machine: the stacks
        # are taken from ranks that reached their hang.
        run_distributed(
            _talk_then_sleep_on_rank_one,
            2,
            timeout_s=hang_guard(6),
            log_dir=tmp_path,
            on_logs=seen.append,
        )
    err = info.value
    assert err.pending == [0, 1]
    assert "_stuck_in_a_named_frame" in err.stacks[1]
    assert "Stack of rank 1 at the timeout" in str(err)
    assert "barrier" in err.stacks[0]  # rank 0 is inside the collective
    assert _children_of_this_process() == []
    (logs,) = seen
    sections = dict(logs.sections(10_000))
    assert sections["stdout rank 0"].strip() == "hello from rank 0"
    assert "warning from rank 1" in sections["stderr rank 1"]
    assert "_stuck_in_a_named_frame" in sections["stderr rank 1 stack at the timeout"]


def test_a_raising_rank_comes_with_the_other_ranks_output() -> None:
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_talk_then_raise_on_rank_zero, 2, timeout_s=hang_guard(60))
    assert info.value.rank == 0
    assert "rank zero gives up" in str(info.value)
    assert "rank 1 stdout" in str(info.value) and "rank 1 got this far" in str(info.value)
    assert _children_of_this_process() == []


def test_sections_are_bounded(tmp_path: Path) -> None:
    logs = RankLogs(tmp_path, 1, "gloo")
    logs.path(0, "err").write_text("x" * 5000 + "END")
    ((name, text),) = logs.sections(100)
    assert name == "stderr rank 0"
    assert text.endswith("END") and "first 4903 bytes left out" in text and len(text) < 200


def test_the_caller_holds_the_store_and_ranks_see_its_port() -> None:
    """No port is probed and released: the ranks meet at the store the caller holds."""
    ports = run_distributed(_store_port, 2, timeout_s=hang_guard(60))
    assert ports[0] == ports[1] > 0


_INTERRUPTED = """
    import os, signal, sys, threading, time
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {tests!r} + '/..']
    from rl_e2e.distributed import run_distributed
    from test_distributed import _talk_then_sleep_on_rank_one
    def interrupt(signum, frame):
        raise KeyboardInterrupt("as pytest-timeout's signal method does")
    def alarm_once_rank_one_hangs():
        out = Path({logs!r}) / "rank1.out"
        while not (out.exists() and out.read_text()):
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGALRM)
    if __name__ == "__main__":
        signal.signal(signal.SIGALRM, interrupt)
        threading.Thread(target=alarm_once_rank_one_hangs, daemon=True).start()
        try:
            run_distributed(_talk_then_sleep_on_rank_one, 2, timeout_s=600, log_dir={logs!r})
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
"""


def test_an_interrupted_caller_takes_the_stacks_and_leaves_no_rank(tmp_path: Path) -> None:
    """pytest-timeout (signal method) or Ctrl-C interrupt the caller: stacks, then no process."""
    script = tmp_path / "interrupted.py"
    logs = tmp_path / "logs"
    script.write_text(
        textwrap.dedent(_INTERRUPTED).format(tests=str(Path(__file__).parent), logs=str(logs))
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=hang_guard(60)
    )
    assert "INTERRUPTED" in done.stdout, done.stderr[-3000:]
    assert "_stuck_in_a_named_frame" in (logs / "rank1.stack").read_text()
    assert _processes_running(script) == []


_KILLED = """
    import sys
    sys.path[:0] = [{tests!r}, {tests!r} + '/..']
    from rl_e2e.distributed import run_distributed
    from test_distributed import _talk_then_sleep_on_rank_one
    if __name__ == "__main__":
        run_distributed(_talk_then_sleep_on_rank_one, 2, timeout_s=600, log_dir={logs!r})
"""


def test_a_caller_killed_with_sigkill_leaves_no_rank_and_no_fork_server(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    logs = tmp_path / "logs"
    script.write_text(
        textwrap.dedent(_KILLED).format(tests=str(Path(__file__).parent), logs=str(logs))
    )
    # multiprocessing puts the fork server's socket in a pymp-* directory under the
    # caller's TMPDIR and removes it at the caller's exit, which SIGKILL skips.
    caller_tmp = tempfile.mkdtemp(prefix="killed", dir="/tmp")  # short: a socket path
    try:
        caller = subprocess.Popen(
            [sys.executable, str(script)], env={**os.environ, "TMPDIR": caller_tmp}
        )
        try:
            deadline = time.monotonic() + hang_guard(30)
            while not (logs / "rank1.out").exists() or not (logs / "rank1.out").read_text():
                assert time.monotonic() < deadline, "the ranks never started"
                time.sleep(0.2)
            tree = psutil.Process(caller.pid).children(recursive=True)
            # The server and the two ranks it forked, which show its command line.
            assert sum("multiprocessing.forkserver" in " ".join(_cmdline(p)) for p in tree) == 3
        finally:
            caller.send_signal(signal.SIGKILL)
            caller.wait()
        _, alive = psutil.wait_procs(tree, timeout=hang_guard(5))
        assert [p.pid for p in alive if "resource_tracker" not in " ".join(_cmdline(p))] == []
        # Only the caller's own directory is left, which its exit would have removed.
        assert [path.name[:5] for path in Path(caller_tmp).iterdir()] == ["pymp-"]
    finally:
        shutil.rmtree(caller_tmp)


_FORKED = """
    import os, sys
    sys.path[:0] = [{tests!r}, {tests!r} + '/..']
    from rl_e2e.distributed import run_distributed
    from test_distributed import _environ_seen
    if __name__ == "__main__":
        servers = set(seen[2] for seen in run_distributed(_environ_seen, 2, "HOME", timeout_s=600))
        child = os.fork()
        if child == 0:
            try:
                seen = run_distributed(_environ_seen, 2, "HOME", timeout_s=600)
                print("NEW SERVERS", len(set(s[2] for s in seen) - servers), flush=True)
            finally:
                os._exit(0)
        os.waitpid(child, 0)
"""


def test_a_process_forked_from_a_caller_runs_on_a_fork_server_of_its_own(tmp_path: Path) -> None:
    """The caller's server is not the forked child's child: the child starts its own."""
    script = tmp_path / "forked.py"
    script.write_text(textwrap.dedent(_FORKED).format(tests=str(Path(__file__).parent)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=hang_guard(60)
    )
    assert "NEW SERVERS 1" in done.stdout, done.stderr[-3000:]
    assert _processes_running(script) == []


_SERVER_HANGS = """
    import sys
    sys.path[:0] = [{tests!r}, {tests!r} + '/..']
    from rl_e2e import distributed
    from test_distributed import _sleep_briefly
    if __name__ == "__main__":
        distributed._SERVER_PRELOAD = "hangs_as_imported"  # a fork server stuck in its imports
        try:
            distributed.run_distributed(_sleep_briefly, 2, 0.0, startup_timeout_s=3)
        except distributed.DistributedTimeoutError as err:
            print("NOT JOINED", err.not_joined, flush=True)
"""


def _run_caller(script: Path, template: str) -> subprocess.CompletedProcess:
    """Write ``template`` as the caller ``script`` and run it in its directory."""
    script.write_text(textwrap.dedent(template).format(tests=str(Path(__file__).parent)))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=script.parent,  # where the server, started in the caller's directory, finds modules
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )


def test_a_fork_server_stuck_in_its_imports_is_cut_by_the_start_up_bound(tmp_path: Path) -> None:
    (tmp_path / "hangs_as_imported.py").write_text("import time\n\ntime.sleep(3600)\n")
    done = _run_caller(tmp_path / "server_hangs.py", _SERVER_HANGS)
    assert "NOT JOINED [0, 1]" in done.stdout, done.stderr[-3000:]
    assert _processes_running(tmp_path / "server_hangs.py") == []


def _preloaded(rank: int, world_size: int, module: str) -> tuple[bool, int, int]:
    """Whether ``module`` was imported before the rank ran anything; the rank's pid and parent."""
    return module in sys.modules, os.getpid(), os.getppid()


_PRELOADED = """
    import sys
    sys.path[:0] = [{tests!r}, {tests!r} + '/..']
    from rl_e2e import distributed
    from test_distributed import _preloaded
    if __name__ == "__main__":
        distributed.set_rank_preload(["no_such_module_here", "marker_module"])
        for seen, pid, parent in distributed.run_distributed(_preloaded, 2, "marker_module"):
            print("RANK", seen, pid, parent, flush=True)
"""


def test_the_fork_server_imports_the_rank_preload_once_for_every_rank(tmp_path: Path) -> None:
    """Each rank finds the named module imported, by the server, once; a missing one is skipped."""
    imported = tmp_path / "imported.pids"
    (tmp_path / "marker_module.py").write_text(
        f"import os\nwith open({str(imported)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    done = _run_caller(tmp_path / "preloaded.py", _PRELOADED)
    ranks = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RANK")]
    assert len(ranks) == 2, done.stdout + done.stderr[-3000:]
    assert all(seen == "True" for seen, _, _ in ranks), ranks
    (server,) = {parent for _, _, parent in ranks}
    assert imported.read_text().split() == [server], (imported.read_text(), ranks)
    assert _processes_running(tmp_path / "preloaded.py") == []


def test_a_rank_preload_entry_that_is_not_a_module_name_is_refused() -> None:
    from rl_e2e import distributed

    before = distributed.rank_preload()
    with pytest.raises(ValueError, match="set_rank_preload: 'torch.' is not a module name"):
        distributed.set_rank_preload(["tensordict", "torch."])
    assert distributed.rank_preload() == before


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _processes_running(script: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter() if str(script) in " ".join(_cmdline(p))]


# --- NCCL (skipped without CUDA) ---


def _nccl_sum(rank: int, world_size: int) -> tuple[torch.Tensor, int, str]:
    t = torch.full((3,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return t.cpu(), torch.cuda.current_device(), dist.get_backend()


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=pytest.mark.gpu1), pytest.param(2, marks=pytest.mark.gpu2)]
)
def test_nccl_ranks_each_get_their_own_card(world_size: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    out = run_distributed(_nccl_sum, world_size, backend="nccl", timeout_s=120)
    total = float(sum(range(1, world_size + 1)))
    for rank, (tensor, device, backend) in enumerate(out):
        assert torch.equal(tensor, torch.full((3,), total))
        assert (device, backend) == (rank, "nccl")
