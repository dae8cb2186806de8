"""One forward per distinct prompt gives the full pass's log-probs, gradients and updates.

The batch is GRPO-shaped (each prompt drawn several times), shuffled, with
prompts of different padding; the shared path (prompt pass, cache indexed out
to every row, response pass) must match the one-sequence-per-row pass.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tensordict import TensorDict

from trainer.config import load_config
from trainer.models import TinySpec, build_char_tokenizer, build_tiny_model
from trainer.rollout import finish_responses
from trainer.workers.compute import (
    PolicyUpdateSettings,
    compute_log_probs,
    response_logits,
    token_log_probs,
    update_policy,
)
from trainer.workers.settings import policy_settings
from trainer.workers.shared_prompt import prompt_groups, share_prompt_enabled

R = 5
PROMPTS = 4
N = 3


def _batch(vocab: int) -> TensorDict:
    """PROMPTS prompts x N responses of varied length, rows shuffled, two left-padded prompts."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(7, vocab, (PROMPTS, 6), generator=gen)
    pmask = torch.ones(PROMPTS, 6, dtype=torch.long)
    pmask[0, :2] = 0
    pmask[2, :1] = 0
    prompts = prompts * pmask  # padding positions hold the pad id (0)
    rows = PROMPTS * N
    responses = torch.randint(7, vocab, (rows, R), generator=gen)
    for i, n in enumerate(torch.randint(1, R + 1, (rows,), generator=gen).tolist()):
        if n < R:
            responses[i, n] = 2
    td = finish_responses(
        prompts.repeat_interleave(N, 0),
        pmask.repeat_interleave(N, 0),
        responses,
        R,
        eos_token_id=2,
        pad_token_id=0,
    )
    td = td[torch.randperm(rows, generator=gen)]
    td["advantages"] = torch.randn(rows, R, generator=gen) * td["response_mask"]
    return td


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_tiny_model(TinySpec(), tok).train()


def test_prompt_groups_find_each_distinct_prompt_wherever_its_rows_are():
    ids = torch.tensor([[0, 5, 6], [1, 5, 6], [0, 5, 6], [1, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = prompt_groups(ids, mask)
    # Row 4 has row 0's tokens but not its padding: a prompt of its own.
    assert len(first) == 3
    assert torch.equal(ids[first][inverse], ids) and torch.equal(mask[first][inverse], mask)
    assert inverse[0] == inverse[2] and inverse[1] == inverse[3]
    assert len({int(inverse[0]), int(inverse[1]), int(inverse[4])}) == 3
    assert sorted(first.tolist()) == [0, 1, 4]  # the first row of each prompt


def test_share_prompt_setting_resolves_and_bad_values_name_the_key():
    assert share_prompt_enabled("auto", 8) and not share_prompt_enabled("auto", 1)
    assert share_prompt_enabled("True", 1) and not share_prompt_enabled("false", 8)
    with pytest.raises(ValueError, match="actor.share_prompt='sometimes'"):
        share_prompt_enabled("sometimes", 8)
    with pytest.raises(ValueError, match="actor.share_prompt"):
        load_config(["actor.share_prompt=sometimes"])
    grpo = load_config(["algo=grpo", "rollout.n=4"])
    assert policy_settings(grpo, 0).share_prompt
    assert not policy_settings(
        load_config(["algo=grpo", "rollout.n=4", "actor.share_prompt=false"]), 0
    ).share_prompt
    assert policy_settings(load_config(["actor.share_prompt=true"]), 0).share_prompt


def test_shared_pass_gives_the_full_pass_log_probs_and_gradients(tok):
    model = _model(tok)
    td = _batch(len(tok))
    grads = {}
    log_probs = {}
    for share in (False, True):
        model.zero_grad()
        logits = response_logits(model, td, temperature=0.7, share_prompt=share)
        lp = token_log_probs(logits, td["responses"])
        (lp * td["advantages"]).sum().backward()
        log_probs[share] = lp.detach()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
    mask = td["response_mask"].bool()
    torch.testing.assert_close(log_probs[True][mask], log_probs[False][mask], rtol=1e-5, atol=1e-5)
    assert grads[False].keys() == grads[True].keys()
    for name, g in grads[False].items():
        assert g.abs().sum() > 0, name  # every parameter, the prompt-only path included, learns
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_shared_log_probs_without_grad_and_in_micro_batches(tok):
    model = _model(tok).eval()
    td = _batch(len(tok))
    want, want_ent = compute_log_probs(model, td, 1.0, micro_batch_size=64)
    got, got_ent = compute_log_probs(model, td, 1.0, micro_batch_size=5, share_prompt=True)
    mask = td["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=1e-5, atol=1e-5)


def test_a_shared_update_ends_with_the_parameters_of_a_full_update(tok):
    td = _batch(len(tok))
    with torch.no_grad():
        td["old_log_probs"] = token_log_probs(
            response_logits(_model(tok), td, 1.0), td["responses"]
        ) + 0.05 * torch.randn(td.batch_size[0], R, generator=torch.Generator().manual_seed(1))
    settings = PolicyUpdateSettings(
        ppo_epochs=2, micro_batch_size=4, entropy_coeff=0.01, grad_clip=1e9
    )
    params = {}
    for share in (False, True):
        model = _model(tok)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        metrics = update_policy(model, opt, td, replace(settings, share_prompt=share))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        params[share] = model.state_dict()
    moved = sum((params[False][k] - _model(tok).state_dict()[k]).abs().sum() for k in params[False])
    assert moved > 0
    for k, v in params[False].items():
        torch.testing.assert_close(params[True][k], v, rtol=1e-4, atol=1e-6, msg=k)
