"""Configuration: defaults, dotted overrides, and validation errors that name the keys."""

from __future__ import annotations

import pytest

from trainer.config import Config, ConfigError, load_config, to_dict


def test_defaults_are_valid_and_describe_the_default_run():
    cfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.algo == "gae" and cfg.use_critic and not cfg.use_reference
    assert cfg.model.path == "tiny" and cfg.data.task == "repeat"
    assert cfg.trainer.num_workers == 0  # auto: every GPU of the cluster, 2 on CPU
    assert to_dict(cfg)["actor"]["optim"]["lr"] == cfg.actor.optim.lr


def test_dotted_overrides_are_typed():
    cfg = load_config(
        [
            "algo=grpo",
            "actor.optim.lr=0.01",
            "data.train_files=[a.jsonl,b.parquet]",
            "trainer.progress=false",
        ]
    )
    assert cfg.algo == "grpo" and not cfg.use_critic
    assert cfg.actor.optim.lr == 0.01
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]
    assert cfg.trainer.progress is False
    assert load_config(["actor.use_kl_loss=true"]).use_reference


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["no_such.key=1"], "no_such"),
        (["trainer.total_steps=many"], "trainer.total_steps"),
        (["trainer.total_steps"], "expected key=value"),
        (["algo=ppo2"], "algo='ppo2'"),
        (["data.overlong_prompts=wrap"], "data.overlong_prompts"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode"),
        (["trainer.colocate=thread"], "trainer.colocate='thread'"),
        (["algorithm.grpo_std_eps=0"], r"algorithm.grpo_std_eps=0.0: must be > 0"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["actor.ppo_mini_batch_size=48"], ["actor.ppo_mini_batch_size", "data.train_batch_size"]),
        (
            [
                "data.train_batch_size=8",
                "actor.ppo_mini_batch_size=8",
                "critic.ppo_mini_batch_size=16",
            ],
            ["critic.ppo_mini_batch_size", "data.train_batch_size"],
        ),
        (["algo=grpo", "rollout.n=1"], ["algo=grpo", "rollout.n=1"]),
        (
            ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"],
            ["actor.use_kl_loss", "algorithm.use_kl_in_reward"],
        ),
        (["algo=grpo", "critic.warmup_steps=3"], ["critic.warmup_steps", "algo=grpo"]),
        (
            ["trainer.num_workers=4", "trainer.ray_num_cpus=2"],
            ["trainer.ray_num_cpus", "trainer.num_workers"],
        ),
        (["data.val_files=[v.jsonl]"], ["data.val_files", "data.train_files"]),
    ],
)
def test_impossible_combinations_name_both_keys(overrides, keys):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    for key in keys:
        assert key in str(info.value)


def test_a_batch_the_workers_do_not_divide_is_accepted():
    cfg = load_config(
        [
            "data.train_batch_size=3",
            "actor.ppo_mini_batch_size=3",
            "critic.ppo_mini_batch_size=1",
            "trainer.num_workers=2",
        ]
    )
    assert cfg.data.train_batch_size == 3  # padded by the driver at run time, not refused


def test_every_key_in_the_docs_table_is_a_config_key():
    import re
    from pathlib import Path

    from omegaconf import OmegaConf

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    keys = re.findall(r"^\| `([a-z_.]+)` \|", doc, re.M)
    assert len(keys) > 40
    known = OmegaConf.structured(Config)
    for key in keys:
        assert OmegaConf.select(known, key, default="<unknown>") != "<unknown>", (
            f"docs name unknown key {key}"
        )


def test_settings_of_a_role_that_does_not_exist_are_not_validated():
    """GRPO has no critic: its mini-batch need not divide the batch (the GAE run still checks)."""
    grpo = load_config(["algo=grpo", "data.train_batch_size=128", "critic.ppo_mini_batch_size=48"])
    assert grpo.critic.ppo_mini_batch_size == 48
    with pytest.raises(ConfigError, match=r"critic.ppo_mini_batch_size=48 does not divide"):
        load_config(["algo=gae", "data.train_batch_size=128", "critic.ppo_mini_batch_size=48"])


def test_a_bare_value_for_a_list_key_is_a_list_of_one():
    assert load_config(["data.train_files=a.jsonl"]).data.train_files == ["a.jsonl"]
    assert load_config(["data.train_files=[a.jsonl]"]).data.train_files == ["a.jsonl"]
    # trainer.loggers too: the bare name reaches validation as the one tracker named (not a
    # string OmegaConf refuses for a list). A name no tracker has, so no tracker's extra is needed.
    for value in ("console", "[console]"):
        with pytest.raises(ConfigError, match=r"^trainer.loggers: unknown tracker 'console': "):
            load_config([f"trainer.loggers={value}"])
    assert load_config(["trainer.total_steps=5"]).trainer.total_steps == 5  # scalars untouched
