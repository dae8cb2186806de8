"""The single-process reference loop learns: the cheapest end-to-end check of the math."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from trainer.loop.reference import ReferenceLoop
from trainer.models import ensure_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def test_grpo_reward_rises_within_a_few_steps(model_dir):
    torch.set_num_threads(1)
    cfg = load_config(
        ["algo=grpo", f"model.path={model_dir}", "trainer.total_steps=18", "trainer.val_every=0"]
    )
    history = ReferenceLoop(cfg).fit(log=lambda m: None)
    first = sum(m["rollout/reward_mean"] for m in history[:3]) / 3
    last = sum(m["rollout/reward_mean"] for m in history[-3:]) / 3
    assert last > 0.08 and last > 3 * first, (first, last)
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in history)


def test_the_reference_loop_refuses_the_vllm_engine_by_name(model_dir):
    cfg = load_config([f"model.path={model_dir}", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout.engine=vllm: the reference loop .*\(hf\) only"):
        ReferenceLoop(cfg)
