"""The engine/actor mismatch statistics and the capped importance weights, without an engine."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.mismatch import (
    TOTALS_REDUCE,
    add_totals,
    cap_weights,
    importance_metrics,
    importance_ratios,
    importance_totals,
    mismatch_by_lag,
    mismatch_metrics,
    mismatch_totals,
    pop_totals,
    tis_weights,
)
from trainer.data import batch as batch_ops
from trainer.models import ensure_tiny_model
from trainer.workers.compute import PolicyUpdateSettings, compute_log_probs, update_policy
from trainer.workers.setup import build_actor


def test_the_statistics_are_over_response_tokens_only():
    actor = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.2, 0.2]]))
    rollout = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.2, 0.25, 0.01]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the big gap at [0, 2] is padding
    got = mismatch_metrics(mismatch_totals(actor, rollout, mask))
    d_logp = [0.0, math.log(0.5 / 0.3), 0.0, math.log(0.25 / 0.2), math.log(0.2 / 0.01)]
    d_prob = [0.0, 0.2, 0.0, 0.05, 0.19]
    assert got["rollout/actor_logprob_diff_mean"] == pytest.approx(sum(d_logp) / 5, rel=1e-5)
    assert got["rollout/actor_logprob_diff_max"] == pytest.approx(max(d_logp), rel=1e-5)
    assert got["rollout/actor_prob_diff_mean"] == pytest.approx(sum(d_prob) / 5, rel=1e-5)
    assert got["rollout/actor_prob_diff_gt_0.1"] == pytest.approx(2 / 5)


def _all_totals(actor, rollout, mask, cap: float, mode: str) -> dict[str, float]:
    """Both families of totals of one piece, as the update computes them."""
    ratios = importance_ratios(actor, rollout, mask)
    weights = cap_weights(ratios, cap, mode)
    return {
        **mismatch_totals(actor, rollout, mask),
        **importance_totals(ratios, weights, mask, cap),
    }


def _all_metrics(totals: dict[str, float]) -> dict[str, float]:
    return {**mismatch_metrics(totals), **importance_metrics(totals)}


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_pieces_and_ranks_combine_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    actor = -torch.rand(6, 5, generator=gen) * 3
    rollout = actor + 0.3 * torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).long()
    whole = _all_metrics(_all_totals(actor, rollout, mask, 1.2, mode))
    assert 0 < whole["rollout/is_truncated_frac"] < 1 and 0 < whole["rollout/is_ess"] < 1
    # Two ranks of three rows, each in two micro-batches, merged as the driver merges them.
    per_rank = []
    for rows in (slice(0, 3), slice(3, 6)):
        acc: dict[str, float] = {}
        for micro in (slice(0, 1), slice(1, 3)):
            a, r, m = actor[rows][micro], rollout[rows][micro], mask[rows][micro]
            acc = add_totals(acc, _all_totals(a, r, m, 1.2, mode))
        per_rank.append({"actor/pg_loss": 0.0, **acc})
    merged = batch_ops.merge_metrics(per_rank, reduce=TOTALS_REDUCE)
    totals = pop_totals(merged)
    assert merged == {"actor/pg_loss": 0.0}
    assert _all_metrics(totals) == pytest.approx(whole)
    assert len(whole) == 8


def test_no_compared_token_reports_nothing_and_shapes_must_agree():
    zeros = torch.zeros(2, 3)
    assert mismatch_metrics(mismatch_totals(zeros, zeros, torch.zeros(2, 3))) == {}
    assert mismatch_metrics({}) == {}
    with pytest.raises(ValueError, match=r"one shape, got \(2, 3\), \(2, 4\)"):
        mismatch_totals(zeros, torch.zeros(2, 4), torch.zeros(2, 3))


def test_truncated_importance_weights():
    actor = torch.log(torch.tensor([0.5, 0.4, 0.01], requires_grad=True))
    rollout = torch.log(torch.tensor([0.5, 0.1, 0.02]))
    w = tis_weights(actor, rollout, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.5])  # 4.0 is capped at 2
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(actor, rollout, cap=0.0)


def test_the_sequence_ratio_is_the_product_over_the_response_and_padding_weighs_nothing():
    actor = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.2, 0.3, 0.6]]))
    rollout = torch.tensor([[math.log(0.25), math.log(0.8), float("nan")], [0.0, 0.0, 0.0]])
    rollout[1] = torch.log(torch.tensor([0.1, 0.3, 0.2]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the nan is padding
    got = importance_ratios(actor, rollout, mask, level="sequence")
    # row 0: 2 * 0.5 = 1; row 1: 2 * 1 * 3 = 6; every response token of a row gets its row's
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 0.0], [6.0, 6.0, 6.0]]))
    token = importance_ratios(actor, rollout, mask)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5, 0.0], [2.0, 1.0, 3.0]]))
    with pytest.raises(ValueError, match="unknown tis_level 'row'"):
        importance_ratios(actor, rollout, mask, level="row")
    with pytest.raises(ValueError, match="needs the response mask"):
        importance_ratios(actor, rollout, level="sequence")


def test_cap_modes_truncate_or_mask_and_padding_weighs_nothing():
    ratios = torch.tensor([[0.5, 1.0, 2.0, 2.5, 7.0]])
    assert cap_weights(ratios, 2.0).tolist() == [[0.5, 1.0, 2.0, 2.0, 2.0]]
    assert cap_weights(ratios, 2.0, "mask").tolist() == [[0.5, 1.0, 2.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="unknown tis_mode 'clip'"):
        cap_weights(ratios, 2.0, "clip")
    actor = torch.zeros(1, 3)
    rollout = torch.tensor([[math.log(0.5), float("nan"), float("-inf")]])
    w = tis_weights(actor, rollout, 1.5, "mask", response_mask=torch.tensor([[1, 0, 0]]))
    assert w.tolist() == [[0.0, 0.0, 0.0]]  # ratio 2 > 1.5 masked; padding 0 even for nan
    assert tis_weights(actor, rollout, 1.5, response_mask=torch.tensor([[1, 0, 0]])).tolist() == [
        [1.5, 0.0, 0.0]
    ]


def test_mismatch_by_lag_splits_the_gap_by_the_rows_policy_version():
    actor = torch.zeros(4, 3)
    rollout = torch.tensor(
        [[0.01, -0.01, 9.0], [0.02, 0.0, 0.0], [0.5, -0.5, 0.2], [9.0, 9.0, 9.0]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    got = mismatch_by_lag(actor, rollout, mask, torch.tensor([0, 0, 2, 5]))
    # lag 5 has no response token: nothing to report; padding (9.0) never counts.
    assert got == pytest.approx(
        {
            "rollout/actor_logprob_diff_mean/lag0": 0.04 / 5,
            "rollout/actor_logprob_diff_mean/lag2": 1.2 / 3,
        }
    )
    with pytest.raises(ValueError, match=r"lag must have shape \(4,\)"):
        mismatch_by_lag(actor, rollout, mask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integers"):
        mismatch_by_lag(actor, rollout, mask, torch.zeros(4))
    with pytest.raises(ValueError, match=">= 0"):
        mismatch_by_lag(actor, rollout, mask, torch.tensor([0, -1, 0, 0]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _on_policy_batch(model_dir: str):
    from trainer.rollout import finish_responses

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(7, 20, (6, 4), generator=gen)
    responses = torch.randint(7, 20, (6, 5), generator=gen)
    td = finish_responses(prompts, torch.ones(6, 4, dtype=torch.long), responses, 5, 2, 0)
    lp, _ = compute_log_probs(build_actor(model_dir), td, 1.0, 64)
    td["rollout_log_probs"] = (lp + 0.2 * torch.randn(6, 5, generator=gen)) * td["response_mask"]
    td["advantages"] = torch.randn(6, 5, generator=gen) * td["response_mask"]
    return td, lp


def test_the_update_pass_measures_the_mismatch_before_it_steps(model_dir):
    td, lp = _on_policy_batch(model_dir)
    torch.manual_seed(0)
    actor = build_actor(model_dir)
    opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    s = PolicyUpdateSettings(micro_batch_size=4, grad_clip=1e9)
    metrics = update_policy(actor, opt, td, s)
    got = mismatch_metrics(pop_totals(metrics))
    want = mismatch_metrics(mismatch_totals(lp, td["rollout_log_probs"], td["response_mask"]))
    assert got == pytest.approx(want, rel=1e-5)
    # With an old-log-prob pass the driver measures it instead: the update reports none,
    # only the importance weights (here all 1: the engine's are the old log-probs).
    totals = pop_totals(update_policy(actor, opt, td.set("old_log_probs", lp), s))
    assert mismatch_metrics(totals) == {}
    equal = td.clone().set("rollout_log_probs", lp)
    totals = pop_totals(update_policy(actor, opt, equal, s))
    assert importance_metrics(totals) == pytest.approx(
        {
            "rollout/is_weight_mean": 1.0,
            "rollout/is_weight_max": 1.0,
            "rollout/is_truncated_frac": 0.0,
            "rollout/is_ess": 1.0,
        }
    )


def test_tis_weights_the_policy_gradient_by_the_capped_ratio(model_dir):
    td, lp = _on_policy_batch(model_dir)
    grads = {}
    for cap in (0.0, 1.5):
        torch.manual_seed(0)
        actor = build_actor(model_dir)
        opt = torch.optim.SGD(actor.parameters(), lr=0.0)
        update_policy(actor, opt, td, PolicyUpdateSettings(grad_clip=1e9, tis_cap=cap))
        grads[cap] = torch.cat([p.grad.flatten() for p in actor.parameters()])
    # Weighted by exp(actor - rollout) capped at 1.5: the same as scaling the advantages.
    w = tis_weights(lp, td["rollout_log_probs"], 1.5) * td["response_mask"]
    torch.manual_seed(0)
    actor = build_actor(model_dir)
    opt = torch.optim.SGD(actor.parameters(), lr=0.0)
    scaled = td.clone().set("advantages", td["advantages"] * w)
    update_policy(actor, opt, scaled, PolicyUpdateSettings(grad_clip=1e9))
    want = torch.cat([p.grad.flatten() for p in actor.parameters()])
    torch.testing.assert_close(grads[1.5], want, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(grads[0.0], grads[1.5])
