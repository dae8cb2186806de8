"""How many worker processes a run asks for: pools, where the critic lives, a local cluster's CPUs.

Pure functions of the configuration, importing nothing heavy (no torch, no
Ray): ``python -m trainer`` sizes its local Ray cluster with them before
torch is loaded, so that Ray starts while the tokenizer and the data are
built. The driver (:func:`trainer.loop.ppo.build_worker_groups`) and the
device plan (:func:`trainer.workers.device.plan_devices`) use the same ones.
"""

from __future__ import annotations

import os

from trainer.config import Config

CPU_WORKERS = 2
"""Data-parallel workers on CPU when ``trainer.num_workers=0`` (auto)."""


def colocation_mode(cfg: Config, colocate: bool | None = None) -> str:
    """``trainer.colocate``, or ``none`` when the caller passed ``colocate=False``."""
    return "none" if colocate is False else cfg.trainer.colocate


def pool_count(cfg: Config, colocate: bool | None = None) -> int:
    """Training pools a run reserves: 2 when the critic has one of its own (colocate=none), else 1.

    The rollout pool (``rollout.workers``) is counted apart: its size is its own.
    """
    return 2 if cfg.use_critic and colocation_mode(cfg, colocate) == "none" else 1


def local_cpus(cfg: Config) -> int:
    """CPUs for a fresh local cluster: one per worker of every pool the run reserves."""
    pools, workers = pool_count(cfg), cfg.trainer.num_workers
    rollout = cfg.rollout_pool_workers
    if workers:
        return pools * workers + rollout
    if cfg.device_request == "cpu":
        return pools * CPU_WORKERS + rollout
    # auto workers on a node whose GPUs Ray is about to count: room for one per GPU
    return max(pools * CPU_WORKERS, os.cpu_count() or 1) + rollout
