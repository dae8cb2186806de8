"""Tests of trainer.distributed on real spawned processes and real gloo groups."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from deadlines import hang_guard

from trainer.distributed import (
    DistributedRankError,
    DistributedTimeoutError,
    default_backend,
    free_port,
    run_distributed,
)

# --- functions run on the ranks (module level: spawn pickles them by name) ---


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


def _children_of_this_process() -> list[psutil.Process]:
    """Live descendants, except multiprocessing's resource tracker (one per
    parent process, started by the first spawn and kept by design)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


# --- tests ---


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_default_backend_matches_cuda_availability() -> None:
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s must be a number > 0, got 0"),
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
    out = run_distributed(_nccl_sum, world_size, timeout_s=120)
    total = float(sum(range(1, world_size + 1)))
    for rank, (tensor, device, backend) in enumerate(out):
        assert torch.equal(tensor, torch.full((3,), total))
        assert (device, backend) == (rank, "nccl")
