"""End-to-end multi-turn training: a few PPO steps of tool-using episodes on the shared cluster.

The same code as ``python -m trainer rollout.multi_turn.enable=true
data.task=lookup`` after ``ray.init`` (``run_on_cluster``), on the module's
Ray cluster with the production runtime env: the episode loop and the
``lookup`` tool run inside the actor workers. The run is short (a few steps
of 16 prompts x 4 samples); it checks that every multi-turn metric arrives,
finite, for training and validation, and that decoded trajectories are
written to the run directory. Learning itself is measured by the full
command (docs/trainer.md). ``[gpu1]`` runs the same on one GPU (HF engine
on CUDA) and skips before Ray starts without CUDA.
"""

from __future__ import annotations

import json
import math

import pytest

from trainer.__main__ import run_on_cluster
from trainer.config import load_config
from trainer.models import ensure_tiny_model

pytestmark = pytest.mark.parametrize(
    "e2e_ray",
    [
        pytest.param({"num_cpus": 2}, id="cpu"),
        pytest.param({"num_cpus": 2, "num_gpus": 1}, marks=pytest.mark.gpu1, id="gpu1"),
    ],
    indirect=True,
)

STEPS = 2
PER_EPISODE = (
    "multi_turn/turns_mean",
    "multi_turn/tool_calls_mean",
    "multi_turn/episodes_with_tool_call",
    "multi_turn/truncated",
    "multi_turn/malformed_calls",
    "multi_turn/unknown_tool_calls",
    "multi_turn/generated_tokens_mean",
    "multi_turn/masked_tokens_mean",
    "tools/lookup/calls",
    "tools/lookup/errors",
    "tools/lookup/timeouts",
    "tools/lookup/reward_mean",
)


@pytest.fixture(scope="module")
def result(e2e_ray, tmp_path_factory):
    model_dir = ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("model-cache"))
    device = (
        ["trainer.use_gpu=true", "trainer.num_workers=1"]
        if e2e_ray.num_gpus
        else ["trainer.num_workers=2"]
    )
    cfg = load_config(
        [
            "rollout.multi_turn.enable=true",
            "data.task=lookup",
            f"model.path={model_dir}",
            "algo=grpo",
            "rollout.n=4",
            "data.train_batch_size=16",
            "actor.ppo_mini_batch_size=16",
            "critic.ppo_mini_batch_size=16",
            "data.num_val_examples=16",
            f"trainer.total_steps={STEPS}",
            f"trainer.val_every={STEPS}",
            "trainer.progress=false",
            "trainer.tensorboard=false",
            f"trainer.run_dir={tmp_path_factory.mktemp('multiturn')}",
            *device,
        ]
    )
    return run_on_cluster(cfg)


def test_multi_turn_metrics_are_present_and_finite(result):
    assert len(result.history) == STEPS
    for step, m in enumerate(result.history, 1):
        keys = [f"rollout/{k}" for k in PER_EPISODE] + ["actor/pg_loss", "rollout/reward_mean"]
        if step == STEPS:
            keys += [f"val/{k}" for k in PER_EPISODE] + ["val/reward_mean"]
        for key in keys:
            assert key in m, f"step {step}: {key} missing; have {sorted(m)}"
            assert math.isfinite(m[key]), f"step {step}: {key}={m[key]}"
        assert m["rollout/multi_turn/turns_mean"] >= 1
        assert m["rollout/multi_turn/generated_tokens_mean"] > 0


def test_decoded_trajectories_are_in_the_run_directory(result):
    lines = (result.run_dir / "trajectories.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 4  # rollout.multi_turn.log_trajectories at the one validation
    for r in records:
        assert r["split"] == "val" and r["step"] == STEPS
        assert r["prompt"].endswith("<|assistant|>") and r["messages"][0]["role"] == "assistant"
        assert 0.0 <= r["reward"] <= 1.0
