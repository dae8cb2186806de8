"""Translate the configuration into the settings the compute functions take."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import Config, parse_size
from trainer.rollout import SamplingParams
from trainer.workers.compute import PolicyUpdateSettings, ValueUpdateSettings
from trainer.workers.shared_prompt import share_prompt_enabled


def policy_settings(cfg: Config, step: int) -> PolicyUpdateSettings:
    """Actor update settings; the shuffle seed varies with the step, reproducibly."""
    a = cfg.actor
    return PolicyUpdateSettings(
        ppo_epochs=a.ppo_epochs,
        num_mini_batches=cfg.data.train_batch_size // a.ppo_mini_batch_size,
        micro_batch_size=a.micro_batch_size,
        micro_batch_tokens=a.micro_batch_tokens,
        clip_low=a.clip_ratio_low,
        clip_high=a.clip_ratio_high,
        clip_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        entropy_coeff=a.entropy_coeff,
        grad_clip=a.grad_clip,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        temperature=cfg.rollout.temperature,
        shuffle_seed=cfg.seed * 1_000_003 + step,
        share_prompt=share_prompt(cfg),
        tis_cap=cfg.importance_cap,
        tis_mode=cfg.rollout.tis_mode,
        tis_level=cfg.importance_level,
    )


def share_prompt(cfg: Config) -> bool:
    """Whether the actor and reference score each distinct prompt once (``actor.share_prompt``)."""
    return share_prompt_enabled(cfg.actor.share_prompt, cfg.rollout.n)


def value_settings(cfg: Config, step: int) -> ValueUpdateSettings:
    """Critic update settings."""
    c = cfg.critic
    return ValueUpdateSettings(
        ppo_epochs=c.ppo_epochs,
        num_mini_batches=cfg.data.train_batch_size // c.ppo_mini_batch_size,
        micro_batch_size=c.micro_batch_size,
        micro_batch_tokens=c.micro_batch_tokens,
        cliprange_value=c.cliprange_value,
        loss_agg_mode=c.loss_agg_mode,
        grad_clip=c.grad_clip,
        shuffle_seed=cfg.seed * 1_000_003 + step + 7,
    )


def sampling_params(cfg: Config, max_new_tokens: int, validation: bool = False) -> SamplingParams:
    """Training sampling, or validation sampling (``rollout.val_temperature`` if >= 0)."""
    r = cfg.rollout
    temp = r.val_temperature if validation and r.val_temperature >= 0 else r.temperature
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temp, top_p=r.top_p)


def engine_options(cfg: Config, model_path: str, device: torch.device, rank: int) -> dict[str, Any]:
    """Settings of a rollout engine that holds its own copy of the model (vLLM).

    Each rank samples with its own seed, as the HF engine does through
    :func:`trainer.workers.actor.seed_worker`.
    """
    if cfg.rollout.engine == "hf":
        return {}
    return {
        "model_path": model_path,
        "device": device,
        "kv_cache_memory": parse_size(cfg.rollout.kv_cache_memory),
        "max_num_seqs": cfg.rollout.max_num_seqs,
        "seed": cfg.seed * 9973 + rank,
    }
