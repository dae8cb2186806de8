"""trainer.algorithms.ppo_math against values computed by hand on small inputs.

Each expected number is written out (or derived in one line from the
docstring's formula) next to the case it comes from, so a reader can check it
without running anything.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer.algorithms import ppo_math as algos
from trainer.algorithms.ppo_math import (
    AdaptiveKLController,
    AggNorm,
    FixedKLController,
    agg_norm,
    aggregate,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    value_loss,
)

T = torch.tensor


def close(actual: torch.Tensor, expected, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=rtol, atol=atol
    )


def whiten(values: list[float]) -> list[float]:
    """The docstring's whitening, with the standard library's unbiased stdev."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / math.sqrt(std**2 + 1e-8) for v in values]


# --------------------------------------------------------------------------- GAE


def test_gae_hand_computed_with_masked_middle_and_right_padding() -> None:
    gamma, lam = 0.9, 0.5  # gamma * lam = 0.45
    rewards = T([[0.0, 0.0, 1.0], [0.0, 5.0, 2.0], [3.0, 7.0, 7.0]])
    values = T([[0.5, 0.2, 0.4], [1.0, 9.0, 0.5], [1.0, 8.0, 8.0]])
    mask = T([[1, 1, 1], [1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    # row 0: A2 = 1 - 0.4 = 0.6
    #        A1 = (0 + 0.9*0.4 - 0.2) + 0.45*0.6 = 0.16 + 0.27 = 0.43
    #        A0 = (0 + 0.9*0.2 - 0.5) + 0.45*0.43 = -0.32 + 0.1935 = -0.1265
    # row 1: the masked middle is skipped: A2 = 2 - 0.5 = 1.5,
    #        A0 = (0 + 0.9*0.5 - 1.0) + 0.45*1.5 = -0.55 + 0.675 = 0.125
    # row 2: rewards/values past the mask are ignored: A0 = 3 - 1 = 2
    raw = [-0.1265, 0.43, 0.6, 0.125, 1.5, 2.0]
    close(ret, [[0.3735, 0.63, 1.0], [1.125, 0.0, 2.0], [3.0, 0.0, 0.0]])
    w = whiten(raw)
    close(adv, [[w[0], w[1], w[2]], [w[3], 0.0, w[4]], [w[5], 0.0, 0.0]])


def test_gae_gamma_lam_one_is_return_minus_value() -> None:
    # gamma = lam = 1: A_t = sum of future rewards - V_t; returns = reward-to-go.
    rewards = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    values = T([[0.5, 0.5, 0.5], [1.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 1.0)
    close(ret, [[6.0, 5.0, 3.0], [4.0, 0.0, 0.0]])
    w = whiten([5.5, 4.5, 2.5, 3.0])
    close(adv, [[w[0], w[1], w[2]], [w[3], 0.0, 0.0]])


def test_gae_needs_two_tokens_to_whiten_and_matching_shapes() -> None:
    with pytest.raises(ValueError, match="at least 2 unmasked tokens, got 1"):
        gae_advantages(T([[1.0, 0.0]]), T([[0.0, 0.0]]), T([[1, 0]]), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"values has shape \(1, 3\) but token_rewards"):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), 1.0, 1.0)


# --------------------------------------------------------------------------- GRPO / RLOO

# Scores (sum of rewards over the mask): a = [1, 0, 2], b = [3, 3], c = [4] (alone).
GROUP_REWARDS = T(
    [
        [0.5, 0.5, 9.0],  # mask [1, 1, 0] -> 1
        [0.0, 0.0, 0.0],  # -> 0
        [1.0, 1.0, 0.0],  # -> 2
        [3.0, 0.0, 0.0],  # -> 3
        [1.0, 1.0, 1.0],  # -> 3
        [4.0, 8.0, 8.0],  # mask [1, 0, 0] -> 4
    ]
)
GROUP_MASK = T([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
GROUP_IDS = ["a", "a", "a", "b", "b", "c"]


def per_token(seq_values: list[float], mask: torch.Tensor = GROUP_MASK) -> torch.Tensor:
    return T(seq_values)[:, None] * mask.float()


def test_grpo_normalised_by_group_std_and_group_of_one() -> None:
    adv, ret = grpo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS)
    eps = 1e-6
    # a: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1; b: std 0; c alone: mean 0, std 1
    expected = [0.0, -1 / (1 + eps), 1 / (1 + eps), 0.0, 0.0, 4 / (1 + eps)]
    close(adv, per_token(expected))
    close(ret, adv)


def test_grpo_without_std_and_with_tensor_group_ids() -> None:
    ids = T([7, 7, 7, 2, 2, 5])
    adv, _ = grpo_advantages(GROUP_REWARDS, GROUP_MASK, ids, norm_by_std=False)
    close(adv, per_token([0.0, -1.0, 1.0, 0.0, 0.0, 4.0]))


def test_grpo_group_ids_must_match_the_batch() -> None:
    with pytest.raises(ValueError, match="group_ids has 2 entries but the batch has 6 rows"):
        grpo_advantages(GROUP_REWARDS, GROUP_MASK, ["a", "b"])


def test_rloo_leave_one_out_and_group_of_one() -> None:
    adv, ret = rloo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS)
    # a: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5  (= 3/2 * (s - 1))
    # b: 3 - 3 = 0 twice; c alone: baseline 0 -> 4
    close(adv, per_token([0.0, -1.5, 1.5, 0.0, 0.0, 4.0]))
    close(ret, adv)


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_discounted_return_resets_at_the_mask() -> None:
    rewards = T([[1.0, 0.0, 2.0], [1.0, 4.0, 2.0], [5.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 1], [1, 0, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1: G2 = 2, the masked G1 = 0 resets the sum, G0 = 1 + 0.5*0 = 1
    # row 2: G0 = 5 (a one-token sequence)
    close(ret, [[1.5, 1.0, 2.0], [1.0, 0.0, 2.0], [5.0, 0.0, 0.0]])
    w = whiten([1.5, 1.0, 2.0, 1.0, 2.0, 5.0])
    close(adv, [[w[0], w[1], w[2]], [w[3], 0.0, w[4]], [w[5], 0.0, 0.0]])


# --------------------------------------------------------------------------- policy loss

# Tokens (old log-prob 0, so ratio r = exp(log_prob)), clip 0.2, clip_c 3:
#   1. A= 1, r=1.5: max(-1.5, -1.2)  = -1.2   clipped
#   2. A= 1, r=0.5: max(-0.5, -0.8)  = -0.5
#   3. A=-1, r=1.5: max( 1.5,  1.2)  =  1.5   (< dual bound 3)
#   4. A=-1, r=5  : max( 5  ,  1.2)  =  5 -> min(5, 3) = 3   dual-clipped
#   5. A=-2, r=0.5: max( 1.0,  1.6)  =  1.6   clipped (< dual bound 6)
#   6. masked (A=100, r=10)
PL_RATIO = T([[1.5, 0.5, 1.5], [5.0, 0.5, 10.0]])
PL_ADV = T([[1.0, 1.0, -1.0], [-1.0, -2.0, 100.0]])
PL_MASK = T([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_policy_loss_clip_dual_clip_and_metrics() -> None:
    log_prob = PL_RATIO.log().requires_grad_()
    loss, metrics = policy_loss(torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK)
    close(loss, (-1.2 - 0.5 + 1.5 + 3.0 + 1.6) / 5)  # 0.88
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    log_r = [math.log(r) for r in (1.5, 0.5, 1.5, 5.0, 0.5)]
    assert metrics["ppo_kl"] == pytest.approx(-sum(log_r) / 5)
    r = (1.5, 0.5, 1.5, 5.0, 0.5)
    assert metrics["approx_kl"] == pytest.approx(
        sum(ri - 1 - li for ri, li in zip(r, log_r, strict=True)) / 5
    )
    loss.backward()
    # d(-A r)/d log r = -A r where unclipped; 0 where a clip is active or masked.
    close(log_prob.grad, [[0.0, -0.5 / 5, 1.5 / 5], [0.0, 0.0, 0.0]])


def test_policy_loss_without_dual_clip_and_asymmetric_clip() -> None:
    log_prob = PL_RATIO.log()
    loss, metrics = policy_loss(torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK, clip_c=None)
    close(loss, (-1.2 - 0.5 + 1.5 + 5.0 + 1.6) / 5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    # clip_high 0.28 changes token 1 to -1.28; clip_low 0.1 changes token 5 to -2*-(0.9)=1.8
    loss, _ = policy_loss(
        torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK, clip_low=0.1, clip_high=0.28
    )
    close(loss, (-1.28 - 0.5 + 1.5 + 3.0 + 1.8) / 5)


def test_policy_loss_seq_mean_mode_and_bad_arguments() -> None:
    log_prob = PL_RATIO.log()
    loss, _ = policy_loss(torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK, agg="seq-mean-token-mean")
    close(loss, ((-1.2 - 0.5 + 1.5) / 3 + (3.0 + 1.6) / 2) / 2)
    with pytest.raises(ValueError, match="clip_c .* must be > 1.0"):
        policy_loss(torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK, clip_c=1.0)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        policy_loss(torch.zeros(2, 3), log_prob, PL_ADV, PL_MASK, agg="mean")
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\)"):
        policy_loss(torch.zeros(2, 3), log_prob, PL_ADV[:, :2], PL_MASK)


def test_policy_loss_extreme_log_ratio_stays_finite() -> None:
    log_prob = T([[200.0, -200.0]], requires_grad=True)
    loss, metrics = policy_loss(torch.zeros(1, 2), log_prob, T([[-1.0, 1.0]]), T([[1, 1]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert math.isfinite(metrics["approx_kl"])
    # A=-1, r=e^20: dual-clipped at 3; A=1, r=e^-20: max(-2e-9, -0.8) is about 0
    close(loss, (3.0 + 0.0) / 2)


# --------------------------------------------------------------------------- value loss


def test_value_loss_clipping_and_metrics() -> None:
    # 1. V=1,  V_old=0,   R=2:    V_clip=0.5, max(1, 2.25)/2 = 1.125  clipped wins
    # 2. V=1,  V_old=0.8, R=0:    within the clip, max(1, 1)/2 = 0.5
    # 3. V=-1, V_old=0,   R=-0.5: V_clip=-0.5, max(0.25, 0)/2 = 0.125
    # 4. masked
    values = T([[1.0, 1.0], [-1.0, 10.0]], requires_grad=True)
    old = T([[0.0, 0.8], [0.0, 0.0]])
    returns = T([[2.0, 0.0], [-0.5, -10.0]])
    mask = T([[1, 1], [1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    close(loss, (1.125 + 0.5 + 0.125) / 3)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["vpred_mean"] == pytest.approx(1 / 3)
    loss.backward()
    # token 1's loss is the clipped branch, flat in V; token 2: (V - R) / 3; token 3: (V - R) / 3
    close(values.grad, [[0.0, 1.0 / 3], [-0.5 / 3, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    close(loss, (0.5 + 0.5 + 0.125) / 3)
    assert metrics["vf_clipfrac"] == 0.0


# --------------------------------------------------------------------------- KL, entropy

LN2 = math.log(2.0)


def test_kl_penalty_kinds() -> None:
    log_prob = T([0.0, LN2, -LN2, 30.0, -30.0])
    ref = torch.zeros(5)
    close(kl_penalty(log_prob, ref, "k1"), [0.0, LN2, -LN2, 30.0, -30.0])
    close(kl_penalty(log_prob, ref, "abs"), [0.0, LN2, LN2, 30.0, 30.0])
    close(kl_penalty(log_prob, ref, "k2"), [0.0, LN2**2 / 2, LN2**2 / 2, 450.0, 450.0])
    # k3 = exp(-d) - 1 + d: d=ln2 -> 0.5 - 1 + ln2; d=-ln2 -> 2 - 1 - ln2; |d|=30 -> capped at 10
    close(kl_penalty(log_prob, ref, "k3"), [0.0, LN2 - 0.5, 1 - LN2, 10.0, 10.0])
    with pytest.raises(ValueError, match="unknown KL penalty kind 'k4'"):
        kl_penalty(log_prob, ref, "k4")


def test_entropy_from_logits() -> None:
    logits = T([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]])
    # uniform over 4 -> ln 4; probabilities (1/4, 3/4, 0, 0) -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(torch.zeros(2, 3, 5)).shape == (2, 3)


# --------------------------------------------------------------------------- KL controllers


def test_fixed_kl_controller() -> None:
    ctl = FixedKLController(0.1)
    ctl.update(current_kl=50.0, n_steps=1000)
    assert ctl.value == 0.1
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        FixedKLController(-1.0)


def test_adaptive_kl_controller_follows_the_proportional_rule() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=500)  # error 0.5 -> capped 0.2: x (1 + 0.2*0.05)
    assert ctl.value == pytest.approx(0.202)
    ctl.update(current_kl=3.0, n_steps=1000)  # error -0.5 -> -0.2: x (1 - 0.02)
    assert ctl.value == pytest.approx(0.202 * 0.98)
    ctl.update(current_kl=6.6, n_steps=1000)  # error 0.1: x (1 + 0.01)
    assert ctl.value == pytest.approx(0.202 * 0.98 * 1.01)
    resumed = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        ctl.update(math.nan, 1)


# --------------------------------------------------------------------------- aggregation

# row 0: 3 tokens, sum 6; row 1: 1 token, sum 5; row 2: fully masked
AGG_LOSS = T([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
AGG_MASK = T([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 11 / 4),
        ("seq-mean-token-sum", (6 + 5) / 2),  # the fully masked row is left out
        ("seq-mean-token-mean", (6 / 3 + 5 / 1) / 2),
        ("seq-mean-token-sum-norm", (6 / 4 + 5 / 4) / 2),  # padded length 4
    ],
)
def test_aggregate_modes(mode: str, expected: float) -> None:
    loss = AGG_LOSS.clone().requires_grad_()
    out = aggregate(loss, AGG_MASK, mode)
    close(out, expected)
    out.backward()
    assert (loss.grad[AGG_MASK == 0] == 0).all()
    assert (loss.grad[AGG_MASK == 1] > 0).all()


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_fully_masked_batch_is_zero_with_finite_gradient(mode: str) -> None:
    loss = AGG_LOSS.clone().requires_grad_()
    out = aggregate(loss, torch.zeros(3, 4), mode)
    out.backward()
    assert out.item() == 0.0
    assert (loss.grad == 0).all()
    norm = agg_norm(torch.zeros(3, 4), mode)
    assert aggregate(loss, torch.zeros(3, 4), mode, norm=norm).item() == 0.0


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_with_norm_sums_over_micro_batches_to_the_full_batch(mode: str) -> None:
    full = aggregate(AGG_LOSS, AGG_MASK, mode)
    norm = agg_norm(AGG_MASK, mode)
    assert norm == AggNorm(mode, tokens=4.0, seqs=2.0, padded_len=4, world_size=1)
    # micro-batches of 1 and 2 rows, unequal token counts (3, then 1 + 0)
    parts = aggregate(AGG_LOSS[:1], AGG_MASK[:1], mode, norm=norm) + aggregate(
        AGG_LOSS[1:], AGG_MASK[1:], mode, norm=norm
    )
    close(parts, full.item())


def test_aggregate_with_norm_multiplies_by_world_size() -> None:
    norm = AggNorm("token-mean", tokens=8.0, seqs=3.0, padded_len=4, world_size=2)
    close(aggregate(AGG_LOSS, AGG_MASK, "token-mean", norm=norm), 11 / 8 * 2)
    norm = AggNorm("seq-mean-token-sum-norm", tokens=8.0, seqs=3.0, padded_len=5, world_size=2)
    close(aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", norm=norm), 11 / 5 / 3 * 2)


def test_aggregate_refuses_bad_mode_shape_and_mismatched_norm() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate(AGG_LOSS, AGG_MASK, "sum")
    with pytest.raises(ValueError, match=r"loss must have shape \(batch, tokens\), got \(4,\)"):
        aggregate(AGG_LOSS[0], AGG_MASK[0], "token-mean")
    with pytest.raises(ValueError, match="norm was computed for mode 'token-mean'"):
        aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum", norm=agg_norm(AGG_MASK, "token-mean"))
