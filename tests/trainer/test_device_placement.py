"""Every tensor the trainer makes lands on the device of the data it joins.

CI has no GPU, so the CUDA bug class "a tensor allocated without ``device=``
meets data on the card" is caught here another way: the code under test runs
on CPU inputs while the *default* device is ``meta``. A tensor created without
an explicit device then lands on ``meta``, and the first operation that mixes
it with the CPU data raises, exactly as a CPU allocation meeting CUDA data
does on a GPU node. Each test also asserts where every output lives.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tensordict import TensorDict

from trainer.algorithms import ppo_math as algos
from trainer.data import batch as batch_ops
from trainer.data.batch import group_ids_for
from trainer.loop.ppo import (
    apply_kl_in_reward,
    compute_advantages,
    pad_for_update,
    token_level_rewards,
)
from trainer.rollout.base import finish_responses
from trainer.workers.compute import (
    PolicyUpdateSettings,
    ValueUpdateSettings,
    compute_log_probs,
    compute_values,
    update_policy,
    update_value,
)

CPU = torch.device("cpu")
EOS, PAD = 2, 0


@pytest.fixture
def default_meta() -> Iterator[None]:
    """Make ``meta`` the default device for factory calls without ``device=``."""
    with torch.device("meta"):
        yield


def _on_cpu(td: TensorDict) -> None:
    for key, value in td.items(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor):
            assert value.device == CPU, f"{key} is on {value.device}"


def test_the_guard_catches_an_allocation_without_a_device(default_meta: None) -> None:
    """The premise of this file: under the meta default, the old bug raises."""
    data = torch.ones(2, 3, device=CPU)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.cat([data, torch.zeros(2, 3)], dim=1).sum().item()


def _rollout(device: torch.device = CPU) -> TensorDict:
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]], device=device)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)
    generated = torch.tensor([[4, EOS, 4], [4, 4, 4]], device=device)
    return finish_responses(prompt_ids, prompt_mask, generated, 4, EOS, PAD)


def test_finish_responses_builds_on_the_prompts_device(default_meta: None) -> None:
    out = _rollout()
    _on_cpu(out)
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert out["responses"].tolist() == [[4, EOS, PAD, PAD], [4, 4, 4, PAD]]


def test_finish_responses_moves_engine_output_to_the_prompts_device() -> None:
    """An engine may hand back its tokens elsewhere (vLLM: lists on the host)."""
    prompt_ids = torch.tensor([[5, 6]], device="meta")
    prompt_mask = torch.ones(1, 2, dtype=torch.long, device="meta")
    out = finish_responses(prompt_ids, prompt_mask, torch.tensor([[4, EOS]]), 3, EOS, PAD)
    assert {v.device.type for v in out.values()} == {"meta"}


def test_driver_step_math_stays_on_the_batch_device(default_meta: None) -> None:
    batch = _rollout()
    mask = batch["response_mask"]
    scores = torch.tensor([1.0, 0.0], device=CPU)
    rewards = token_level_rewards(scores, mask)
    assert rewards.device == CPU and rewards[0, 1] == 1.0
    lp = torch.full(mask.shape, -1.0, device=CPU)
    shaped, _ = apply_kl_in_reward(rewards, lp, lp - 0.1, mask, "k1", 0.1)
    assert shaped.device == CPU
    groups = group_ids_for(1, 2, device=CPU)
    values = torch.zeros(mask.shape, device=CPU)
    for algo in ("gae", "grpo", "grpo_no_std", "rloo", "reinforce_pp"):
        adv, ret = compute_advantages(algo, rewards, mask, groups, values, 1.0, 1.0)
        assert adv.device == CPU and ret.device == CPU, algo
        assert torch.isfinite(adv).all(), algo
    # Group ids given as Python values (e.g. prompt uids) too.
    adv, _ = algos.grpo_advantages(rewards, mask, ["a", "a"])
    assert adv.device == CPU


def test_padding_and_repeating_build_indices_on_the_batch_device(default_meta: None) -> None:
    batch = _rollout()
    batch["advantages"] = torch.ones(batch["response_mask"].shape, device=CPU)
    padded = pad_for_update(batch, 3)
    assert padded.batch_size[0] == 3
    _on_cpu(padded)
    assert padded["response_mask"][2].sum() == 0
    repeated = batch_ops.repeat_interleave(batch, 2)
    _on_cpu(repeated)
    assert repeated["prompts"][1].tolist() == batch["prompts"][0].tolist()


@pytest.fixture(scope="module")
def tiny_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    from trainer.models import TinySpec, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    spec = TinySpec(16, 32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    return build_tiny_model(spec, tok), build_tiny_model(spec, tok)


def test_model_side_step_math_stays_on_the_batch_device(
    tiny_models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    policy, critic = tiny_models
    batch = _rollout()
    mask = batch["response_mask"]
    with torch.device("meta"):
        lp, ent = compute_log_probs(policy, batch, 1.0, micro_batch_size=1)
        assert lp.device == CPU and ent.device == CPU
        batch["old_log_probs"] = lp
        batch["advantages"] = torch.where(mask.bool(), 1.0, 0.0).to(CPU)
        batch["values"] = torch.zeros(mask.shape, device=CPU)
        batch["returns"] = torch.ones(mask.shape, device=CPU)
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        metrics = update_policy(
            policy, opt, batch, PolicyUpdateSettings(num_mini_batches=2, micro_batch_size=1)
        )
        assert all(torch.isfinite(torch.tensor(v, device=CPU)) for v in metrics.values())
        values = compute_values(critic, batch, micro_batch_size=1)
        assert values.device == CPU
        vopt = torch.optim.SGD(critic.parameters(), lr=0.0)
        vm = update_value(critic, vopt, batch, ValueUpdateSettings(num_mini_batches=2))
        assert "critic/vf_loss" in vm
