"""Building the models and optimizers a worker (or the reference loop) trains."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForTokenClassification

from trainer.config import OptimConfig
from trainer.models import load_causal_lm, quiet_transformers


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0.

    Dropout would make log-probs differ between the rollout-time pass and the
    update pass (a biased PPO ratio) and make runs irreproducible; the token
    classification head that the critic uses has dropout 0.1 by default.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def build_actor(path: str) -> torch.nn.Module:
    """The policy: any causal LM loaded through ``from_pretrained``, dropout off."""
    return disable_dropout(load_causal_lm(path))


def build_critic(path: str, seed: int) -> torch.nn.Module:
    """The critic: the same backbone with a one-output token head, zero-initialised.

    A zero head makes the first values 0, so the first advantages are the raw
    returns rather than noise from a random head.
    """
    quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, local_files_only=True
        )
    head = critic.get_output_embeddings() if hasattr(critic, "get_output_embeddings") else None
    head = head if isinstance(head, torch.nn.Linear) else getattr(critic, "score", None)
    if isinstance(head, torch.nn.Linear):
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
    return disable_dropout(critic)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with a linear warm-up to ``cfg.lr`` then constant.

    The fused kernel (one pass over all parameters, CPU and CUDA) for plain
    tensors; FSDP2's sharded DTensor parameters keep the default implementation.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=not any(isinstance(p, DTensor) for p in params) or None,
    )
    warm = max(int(cfg.warmup_steps), 0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / warm) if warm else 1.0
    )
    return opt, sched
