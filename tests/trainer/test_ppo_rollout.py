"""The rollout engine and the driver's pure step math on hand-made tensors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainer.data.batch import group_ids_for
from trainer.data.rewards import char_match
from trainer.loop.ppo import (
    compute_advantages,
    decode_responses,
    explained_variance,
    finished_mask,
    pad_for_update,
    score_responses,
    token_level_rewards,
)
from trainer.models import build_char_tokenizer, ensure_tiny_model, load_causal_lm, load_tokenizer
from trainer.rollout import SamplingParams, build_engine, finish_responses

EOS, PAD = 2, 0


def test_finish_responses_cuts_after_first_eos_and_pads():
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    pmask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    gen = torch.tensor([[11, EOS, 12], [13, 14, 15]])
    td = finish_responses(prompts, pmask, gen, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    assert td["responses"].tolist() == [[11, EOS, PAD, PAD], [13, 14, 15, PAD]]
    assert td["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert td["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert td["position_ids"][0].tolist()[:5] == [
        0,
        0,
        1,
        2,
        3,
    ]  # left padding does not shift positions
    assert td["input_ids"].shape == (2, 7)


def test_sampling_params_and_engine_names_are_checked():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=1, temperature=-1)
    if importlib.util.find_spec("vllm") is None:  # the engine itself: tests/trainer/test_vllm.py
        with pytest.raises(ImportError, match="rollout.engine=vllm needs the 'vllm' package"):
            build_engine("vllm", None, build_char_tokenizer())
    with pytest.raises(ValueError, match="rollout.engine='trt'"):
        build_engine("trt", None, build_char_tokenizer())


def test_hf_engine_generates_the_shared_layout(tmp_path):
    path = str(ensure_tiny_model(cache_dir=tmp_path))
    tok, model = load_tokenizer(path), load_causal_lm(path)
    enc = tok(["1*2=", "~123="], padding=True, return_tensors="pt")
    from tensordict import TensorDict

    prompts = TensorDict(dict(enc), batch_size=[2])
    engine = build_engine("hf", model, tok)
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert out["responses"].shape == (2, 5) and out["input_ids"].shape == (
        2,
        enc["input_ids"].shape[1] + 5,
    )
    greedy = [
        engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0)) for _ in range(2)
    ]
    assert torch.equal(greedy[0]["responses"], greedy[1]["responses"])
    model.train()
    engine.generate(prompts, SamplingParams(max_new_tokens=2))
    assert model.training  # generate() puts the module back in the mode it found


def test_token_rewards_sit_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = token_level_rewards(torch.tensor([0.5, 1.0, 0.7]), mask)
    assert out.tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]


def test_unfinished_responses_score_zero_and_specials_are_kept():
    tok = build_char_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    responses = torch.tensor([ids("33") + [eos, pad], ids("3333"), ids("3") + [pad, eos, pad]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    assert decode_responses(tok, responses, mask) == ["33", "3333", "3"]  # as TRL and verl read
    texts = decode_responses(tok, responses, mask, skip_special_tokens=False)
    assert texts == ["33", "3333", "3<pad>"]  # the strict reading: a pad is not a clean stop
    done = finished_mask(responses, mask, eos)
    assert done.tolist() == [True, False, True]
    scores = score_responses(char_match, texts, ["33", "3333", "3"], [{}, {}, {}], done)
    assert scores.tolist() == pytest.approx([1.0, 0.0, 1 / 6])  # '3<pad>' is 6 chars, 1 right


def test_group_ids_advantages_and_explained_variance():
    assert group_ids_for(2, 3).tolist() == [0, 0, 0, 1, 1, 1]
    mask = torch.ones(4, 2)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    adv, _ = compute_advantages("grpo", rewards, mask, group_ids_for(2, 2), None, 1.0, 1.0)
    assert adv[0, 0] > 0 > adv[1, 0] and torch.allclose(adv[2], torch.zeros(2))  # equal pair: 0
    with pytest.raises(ValueError, match="algo=gae needs critic values"):
        compute_advantages("gae", rewards, mask, group_ids_for(2, 2), None, 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("dqn", rewards, mask, group_ids_for(2, 2), None, 1.0, 1.0)
    # (r - mean) / (std + eps), std unbiased: the pair (1, 0) has std sqrt(1/2)
    for eps in (1e-6, 1e-4, 0.5):
        adv, _ = compute_advantages(
            "grpo", rewards, mask, group_ids_for(2, 2), None, 1.0, 1.0, grpo_std_eps=eps
        )
        assert adv[0, 0].item() == pytest.approx(0.5 / (0.5**0.5 + eps), rel=1e-6)
    ret = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert explained_variance(ret, ret, torch.ones(2, 2)) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(2, 2), ret, torch.ones(2, 2)) == pytest.approx(0.0)


def test_pad_for_update_adds_rows_without_loss():
    from tensordict import TensorDict

    td = TensorDict(
        {"response_mask": torch.ones(3, 2), "advantages": torch.ones(3, 2)}, batch_size=[3]
    )
    out = pad_for_update(td, 4)
    assert out.batch_size[0] == 4
    assert out["response_mask"][3].sum() == 0 and out["advantages"][3].sum() == 0
    assert td["response_mask"].sum() == 6  # input untouched
    assert pad_for_update(td, 3).batch_size[0] == 3
