"""Data-parallel training by hand: average the gradients over ``torch.distributed``."""

from __future__ import annotations

import torch
import torch.distributed as dist


def average_gradients(model: torch.nn.Module) -> None:
    """Replace each parameter's gradient by its mean over the ranks (what DDP does).

    g <- (1 / W) * sum_r g_r, with W the world size; every rank ends with the same g.
    """
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size


def make_model(seed: int = 0) -> torch.nn.Linear:
    """The same tiny policy head on every rank (same seed, same initial weights)."""
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 1)


def batch(rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the data: a fixed batch of ``size`` inputs and targets."""
    generator = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(size, 4, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True)


def sgd_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One step of SGD (lr 0.1) on the mean squared error, gradients averaged over ranks."""
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    if dist.is_initialized():
        average_gradients(model)
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.1 * param.grad
