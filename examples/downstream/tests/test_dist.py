"""minirl's gradient averaging on real process groups: 2 CPU ranks (gloo), 1 GPU (NCCL)."""

from __future__ import annotations

import pytest
import torch
from minirl.dist import batch, make_model, sgd_step


def _one_step(rank: int, world_size: int, device: str = "cpu") -> list[torch.Tensor]:
    """Each rank: the same model, its own shard, one averaged step; its weights after."""
    model = make_model().to(device)
    inputs, targets = batch(rank)
    sgd_step(model, inputs.to(device), targets.to(device))
    return [param.detach().cpu() for param in model.parameters()]


def _whole_batch_step() -> list[torch.Tensor]:
    """One process, both shards at once: what data parallelism must reproduce."""
    model = make_model()
    shards = [batch(rank) for rank in range(2)]
    sgd_step(model, torch.cat([x for x, _ in shards]), torch.cat([y for _, y in shards]))
    return [param.detach() for param in model.parameters()]


def test_two_ranks_step_like_one_process_on_the_whole_batch(e2e_distributed):
    """Averaged gradients on 2 gloo ranks give both ranks the single-process weights."""
    expected = _whole_batch_step()
    for weights in e2e_distributed(_one_step, 2):
        for got, want in zip(weights, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.gpu1
def test_a_step_over_nccl_on_one_gpu(e2e_distributed_gpu1):
    """The same step on cuda:0 over NCCL; skipped, naming the missing GPU, on CPU."""
    model = make_model()
    sgd_step(model, *batch(0))
    (weights,) = e2e_distributed_gpu1(_one_step, 1, "cuda")
    for got, want in zip(weights, model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach())
