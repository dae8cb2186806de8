"""A PPOTrainer over real Ray worker groups, for tests that drive ``fit`` themselves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainer.config import load_config
from trainer.data.prompts import build_datasets
from trainer.loop.ppo import (
    PPOTrainer,
    build_worker_groups,
    resolve_reward_fn,
    response_length,
    shutdown_worker_groups,
)
from trainer.models import load_tokenizer


@contextmanager
def trainer_on_ray(
    model_dir: str, overrides: list[str], rollout_cls: type | None = None
) -> Iterator[tuple[PPOTrainer, dict[str, Any]]]:
    """``(trainer, groups)`` on the running Ray for ``overrides``; the groups stop on exit."""
    cfg = load_config([f"model.path={model_dir}", *overrides])
    tok = load_tokenizer(model_dir)
    train, val = build_datasets(cfg, tok)
    max_new = response_length(cfg)
    groups = build_worker_groups(cfg, model_dir, max_new, rollout_cls=rollout_cls)
    try:
        for g in groups.values():
            g.init_model()
        trainer = PPOTrainer(
            cfg,
            groups["actor"],
            groups.get("critic"),
            tok,
            train,
            val,
            resolve_reward_fn(cfg),
            max_new,
            cfg.trainer.num_workers,
            groups.get("rollout"),
        )
        yield trainer, groups
    finally:
        shutdown_worker_groups(groups)
