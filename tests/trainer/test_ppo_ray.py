"""The driver on real Ray worker groups: two gloo ranks, colocated actor and critic."""

from __future__ import annotations

import math

import pytest
import ray
import torch
from ray_trainers import trainer_on_ray

from trainer.models import ensure_tiny_model

TINY = [
    "data.train_batch_size=3",  # not divisible by the 2 workers: padded
    "actor.ppo_mini_batch_size=3",
    "critic.ppo_mini_batch_size=3",
    "rollout.n=2",
    "data.num_val_examples=5",
    "data.num_train_examples=32",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "actor.micro_batch_size=2",
    "critic.micro_batch_size=2",
]


@pytest.fixture(scope="module")
def e2e_ray_options():
    """Two CPUs (the defaults), without the workers' logs on the driver."""
    return {"log_to_driver": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _trainer(model_dir, overrides):
    return trainer_on_ray(model_dir, [*TINY, "trainer.num_workers=2", *overrides])


def _finite(history, keys):
    for step, m in enumerate(history, 1):
        for k in keys:
            assert k in m, f"step {step}: metric {k} missing (have {sorted(m)})"
            assert math.isfinite(m[k]), f"step {step}: {k}={m[k]}"


def test_gae_steps_on_two_ranks_report_finite_metrics(e2e_ray, model_dir):
    # Rewards of a random model are mostly 0, so advantages can be all 0: the
    # entropy bonus guarantees a gradient.
    overrides = ["algo=gae", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01"]
    with _trainer(model_dir, overrides) as (trainer, groups):
        before = groups["actor"].state_dict()
        history = trainer.fit()
        after = groups["actor"].state_dict()
    assert len(history) == 2 and trainer.step == 2
    _finite(
        history,
        [
            "rollout/reward_mean",
            "rollout/response_length",
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/approx_kl",
            "actor/kl_loss",
            "actor/entropy",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/grad_norm",
            "timing/gen",
            "timing/update_actor",
            "timing/update_critic",
            "perf/tokens_per_s",
        ],
    )
    assert "critic/explained_variance" in history[0]
    assert "val/reward_mean" in history[1] and 0.0 <= history[1]["val/reward_mean"] <= 1.0
    assert any(not torch.equal(before[k], after[k]) for k in before), "the actor did not change"


def test_grpo_with_kl_in_reward_and_no_critic(e2e_ray, model_dir):
    with _trainer(
        model_dir, ["algo=grpo", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl=adaptive"]
    ) as (trainer, groups):
        assert "critic" not in groups
        history = trainer.fit()
    _finite(history, ["rollout/reward_mean", "actor/pg_loss", "actor/reward_kl", "actor/kl_coef"])
    assert "critic/vf_loss" not in history[0]


def test_ranks_hold_identical_weights_after_updates(e2e_ray, model_dir):
    """Gradients are all-reduced: both ranks' policies stay bit-identical."""
    with _trainer(model_dir, ["algo=grpo"]) as (trainer, groups):
        trainer.fit()
        hosts = groups["actor"].hosts
        per_rank = ray.get([h.call.remote("actor", "state_dict") for h in hosts])
    for k in per_rank[0]:
        assert torch.equal(per_rank[0][k], per_rank[1][k]), k
