"""The tuned GAE defaults and the "choose for me" critic warm-up (-1)."""

from __future__ import annotations

import pytest

from trainer.config import DEFAULT_CRITIC_WARMUP, Config, ConfigError, load_config, to_dict


def test_default_gae_run_warms_the_critic_up_before_the_actor():
    cfg = load_config([])
    assert cfg.algo == "gae"
    assert cfg.critic.warmup_steps == DEFAULT_CRITIC_WARMUP == 3
    assert to_dict(cfg)["critic"]["warmup_steps"] == 3  # config.yaml shows the resolved value


@pytest.mark.parametrize("algo", ["grpo", "grpo_no_std", "rloo", "reinforce_pp"])
def test_algorithms_without_a_critic_resolve_the_warm_up_to_zero(algo):
    assert load_config([f"algo={algo}"]).critic.warmup_steps == 0


def test_an_explicit_warm_up_is_kept():
    assert load_config(["critic.warmup_steps=0"]).critic.warmup_steps == 0
    assert load_config(["critic.warmup_steps=7"]).critic.warmup_steps == 7


def test_a_negative_warm_up_other_than_minus_one_names_the_key():
    with pytest.raises(ConfigError, match=r"critic.warmup_steps=-2: must be >= 0"):
        load_config(["critic.warmup_steps=-2"])


def test_gae_defaults_suit_an_outcome_reward():
    cfg = Config()
    assert cfg.algorithm.gamma == 1.0
    assert 0.9 <= cfg.algorithm.lam < 1.0
    assert cfg.critic.ppo_epochs > cfg.actor.ppo_epochs >= 1
