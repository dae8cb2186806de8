"""Saving and restoring a worker's training state (model, optimizer, scheduler, RNG).

Model, optimizer and scheduler are identical on every data-parallel rank (the
gradients are all-reduced before each step), so rank 0 writes them; every rank
writes its own RNG states, because sampling differs per rank. An FSDP2-sharded
model and its optimizer are gathered into full (unsharded, plain HF-named)
state dicts first, a collective every rank joins, so the file is the same
whatever the strategy and loads back into a plain ``from_pretrained`` model.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.workers import fsdp


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and, when present, CUDA) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(
    directory: str | Path,
    role: str,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
) -> None:
    """Write ``<role>_model.pt`` (+ optimizer, scheduler) from rank 0 and ``<role>_rng_<rank>.pt``."""
    d = Path(directory)
    if fsdp.is_sharded(model):
        model_state = fsdp.full_state_dict(model)
        optim_state = (
            fsdp.full_optimizer_state_dict(model, optimizer) if optimizer is not None else None
        )
    elif rank == 0:
        model_state = model.state_dict()
        optim_state = optimizer.state_dict() if optimizer is not None else None
    if rank == 0:
        payload = {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        torch.save(payload, d / f"{role}_state.pt")
    torch.save(rng_state(), d / f"{role}_rng_{rank}.pt")


def load_training_state(
    directory: str | Path,
    role: str,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
) -> None:
    """Restore what :func:`save_training_state` wrote; errors name the missing file."""
    d = Path(directory)
    state_file, rng_file = d / f"{role}_state.pt", d / f"{role}_rng_{rank}.pt"
    for f in (state_file, rng_file):
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {d}: missing {f.name} (role {role}, rank {rank})")
    payload = torch.load(state_file, map_location="cpu", weights_only=False)
    if fsdp.is_sharded(model):
        fsdp.load_full_state_dict(model, payload["model"])
        if optimizer is not None and payload["optimizer"] is not None:
            fsdp.load_full_optimizer_state_dict(model, optimizer, payload["optimizer"])
    else:
        model.load_state_dict(payload["model"])
        if optimizer is not None and payload["optimizer"] is not None:
            optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload["scheduler"] is not None:
        scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
