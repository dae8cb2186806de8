"""Meant to FAIL: what a failing or hanging N-rank test reports (tests/rl_e2e checks it).

Run by name: ``python -m pytest failing``. Each test fails on purpose.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

# pytest-timeout's limit counts the ranks' start-up: on a loaded machine two ranks
# importing torch may take 20 s and more to reach the hang, whose stack the report
# must show. The runner's own timeout counts from the moment both ranks joined the
# group, so it can be as short as the hang is obvious.
HANG_S = 60
RUNNER_HANG_S = 10


def _rank_zero_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        print("rank 1 reached the barrier", flush=True)
    dist.barrier()
    if rank == 0:
        raise ValueError("rank 0 found a NaN in the advantages")


def wait_for_weights() -> None:
    """Where rank 1 hangs: the stacks at the timeout must name this function."""
    while True:
        time.sleep(0.1)


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        wait_for_weights()
    dist.barrier()  # rank 0 waits here for rank 1, forever


def test_a_rank_raises(e2e_distributed):
    """Fails naming rank 0; the report carries rank 1's output (``Captured stdout rank 1``)."""
    e2e_distributed(_rank_zero_raises, 2)


@pytest.mark.timeout(HANG_S, method="signal")
def test_a_hang_cut_by_pytest_timeout(e2e_distributed):
    """pytest-timeout ends it; the report has each rank's stack at that moment."""
    e2e_distributed(_rank_one_hangs, 2)


def test_a_hang_cut_by_the_runners_timeout(e2e_distributed):
    """The runner's own timeout ends it; its error quotes each pending rank's stack."""
    e2e_distributed(_rank_one_hangs, 2, timeout_s=RUNNER_HANG_S)
