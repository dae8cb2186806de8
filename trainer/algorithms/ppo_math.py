"""The math of PPO-family RL on token sequences: advantages, losses, KL, aggregation.

Pure torch functions of tensors, no model and no I/O, so each one is unit-tested
on hand-computed values. The driver computes advantages on whole batches; the
workers call the losses on micro-batches.

Conventions shared by every function:

- Token tensors have shape (B, T): B sequences (responses), T the padded length.
- ``response_mask`` (bool or 0/1) marks real response tokens; everything at a
  masked position is ignored on input and returned as 0 on output.
- ``group_ids`` names the prompt each sequence was sampled from (a 1-D tensor
  or a sequence of hashables such as uid strings, one per row).
- A sequence's *score* is the sum of its token rewards over the mask.

Aggregation is global. A loss over a mini-batch spread over D data-parallel
ranks and several micro-batches per rank must equal the loss of the whole
mini-batch in one piece, otherwise the parameters after a step depend on how
the batch was split. :func:`agg_norm` computes the mini-batch's denominators
once (all-reduced over the dp group); :func:`aggregate` given that
:class:`AggNorm` divides each micro-batch's local *sum* by the global
denominator and multiplies by D, because DDP/FSDP average gradients over ranks.
Summing micro-batch gradients and averaging over ranks then gives exactly the
gradient of the full-batch loss.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "AggNorm",
    "FixedKLController",
    "agg_norm",
    "aggregate",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
]

AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "k2", "k3", "abs")

# Bound on |log ratio| before exp(): keeps exp finite for any pair of log-probs.
_LOG_RATIO_BOUND = 20.0
# Upper bound of the k3 KL estimate per token (it is >= 0 by construction).
_K3_MAX = 10.0


# --------------------------------------------------------------------------- helpers


def _check_2d(**tensors: torch.Tensor) -> tuple[int, int]:
    """All tensors (B, T) with the same shape; returns (B, T) or raises naming them."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first_name, first = next(iter(shapes.items()))
    if len(first) != 2:
        raise ValueError(f"{first_name} must have shape (batch, tokens), got {first}")
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} has shape {shape} but {first_name} has shape {first}")
    return first


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} has shape {shape} but {first_name} has shape {first}")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    n = m.sum()
    return (x * m).sum() / torch.where(n > 0, n, torch.ones_like(n))


def _masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries, var unbiased (n - 1).

    Masked positions come back as 0.
    """
    m = mask.bool()
    n = int(m.sum())
    if n < 2:
        raise ValueError(f"whitening over response_mask needs at least 2 unmasked tokens, got {n}")
    values = x[m]
    mean = values.mean()
    var = ((values - mean) ** 2).sum() / (n - 1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], batch: int) -> torch.Tensor:
    """Map group ids (tensor or hashables) to 0..G-1 indices, one per row."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch:
            raise ValueError(f"group_ids must have shape ({batch},), got {tuple(group_ids.shape)}")
        return torch.unique(group_ids.cpu(), return_inverse=True)[1]
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch} rows")
    index: dict[Hashable, int] = {}
    return torch.tensor(
        [index.setdefault(g, len(index)) for g in ids], dtype=torch.long, device="cpu"
    )


def _sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), token_rewards, 0).sum(-1)


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group size, group mean, group unbiased std) of ``scores``.

    A group of one has mean 0 and std 1 (there is nothing to compare it with).
    """
    idx = _group_index(group_ids, scores.shape[0]).to(scores.device)
    groups = int(idx.max()) + 1 if idx.numel() else 0
    counts = torch.zeros(groups, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, idx, torch.ones_like(scores))
    mean = torch.zeros_like(counts).index_add_(0, idx, scores) / counts
    sq = torch.zeros_like(counts).index_add_(0, idx, (scores - mean[idx]) ** 2)
    single = counts == 1
    std = torch.where(single, torch.ones_like(sq), torch.sqrt(sq / (counts - 1).clamp(min=1)))
    mean = torch.where(single, torch.zeros_like(mean), mean)
    return counts[idx], mean[idx], std[idx]


# --------------------------------------------------------------------------- advantages


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, then whitening.

    Backwards over the unmasked tokens t of each sequence, with t' the next
    unmasked token after t (none at the end: V(t') = A(t') = 0)::

        delta_t = r_t + gamma * V(t') - V(t)
        A_t     = delta_t + gamma * lam * A(t')
        R_t     = A_t + V(t)                       (returns, before whitening)

    Masked positions are skipped: they neither contribute rewards nor break the
    recursion. The returned advantages are whitened over the mask,
    (A - mean) / sqrt(var + 1e-8) with the unbiased variance. Both outputs are
    0 at masked positions.
    """
    _check_2d(token_rewards=token_rewards, values=values, response_mask=response_mask)
    m = response_mask.bool()
    rewards = token_rewards.to(values.dtype)
    batch, length = values.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(length)):
        valid = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(valid, a_t, 0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, a_t, next_adv)
    returns = torch.where(m, adv + values, 0)
    return _masked_whiten(adv, m), returns


@torch.no_grad()
def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO), the same for every token of a sequence.

    For sequence i with score s_i in group g (mean mu_g, unbiased std sigma_g)::

        A_i = (s_i - mu_g) / (sigma_g + eps)     if norm_by_std
        A_i =  s_i - mu_g                        otherwise (Dr. GRPO's variant)

    A group of one has mu_g = 0 and sigma_g = 1. Returns equal the advantages.
    """
    _check_2d(token_rewards=token_rewards, response_mask=response_mask)
    scores = _sequence_scores(token_rewards, response_mask)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    _, mean, std = _group_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    advantages = torch.where(response_mask.bool(), adv[:, None], 0)
    return advantages, advantages.clone()


@torch.no_grad()
def rloo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: each sequence's baseline is the mean of the others.

    For sequence i in a group of n with mean mu_g::

        A_i = s_i - (sum_{j != i} s_j) / (n - 1) = n / (n - 1) * (s_i - mu_g)

    A group of one has no other sample: its baseline is 0, A_i = s_i. Returns
    equal the advantages.
    """
    _check_2d(token_rewards=token_rewards, response_mask=response_mask)
    scores = _sequence_scores(token_rewards, response_mask)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    size, mean, _ = _group_stats(scores, group_ids)
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    adv = factor * (scores - mean)
    advantages = torch.where(response_mask.bool(), adv[:, None], 0)
    return advantages, advantages.clone()


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return of each token, whitened over the batch.

    Backwards over tokens, with m_t the mask and G_T = 0::

        G_t = m_t * (r_t + gamma * G_{t+1})

    so a masked position resets the sum: rewards past it do not reach the
    tokens before it. Advantages are G whitened over the mask (unbiased
    variance, eps 1e-8); returns are G. Both are 0 at masked positions.
    """
    _check_2d(token_rewards=token_rewards, response_mask=response_mask)
    m = response_mask.bool()
    rewards = token_rewards.to(torch.promote_types(token_rewards.dtype, torch.float32))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, 0)
        returns[:, t] = running
    return _masked_whiten(returns, m), returns


# --------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class AggNorm:
    """Global denominators of one mini-batch, from :func:`agg_norm`.

    ``tokens``: unmasked tokens; ``seqs``: sequences with at least one unmasked
    token; ``padded_len``: the largest padded length T; all over every
    data-parallel rank. ``world_size``: ranks in the dp group, the factor that
    undoes gradient averaging. ``mode``: the aggregation mode it was made for.
    """

    mode: str
    tokens: float
    seqs: float
    padded_len: int
    world_size: int = 1


def agg_norm(mask: torch.Tensor, mode: str, group: dist.ProcessGroup | None = None) -> AggNorm:
    """Denominators of ``mode`` for a whole mini-batch across the dp group.

    ``mask`` (B, T) is this rank's whole local mini-batch (all its
    micro-batches). When torch.distributed is initialised, the counts are
    all-reduced (sum; max for the padded length) over ``group`` (default: the
    world), so every rank must call this collectively. Otherwise the counts
    are local and ``world_size`` is 1.
    """
    _check_mode(mode)
    _check_2d(mask=mask)
    m = mask.bool()
    device = mask.device
    world_size = 1
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size(group)
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    counts = torch.stack([m.sum(), m.any(-1).sum()]).to(device=device, dtype=torch.float64)
    padded = torch.tensor([float(m.shape[1])], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=group)
    tokens, seqs = counts.tolist()
    return AggNorm(mode, tokens, seqs, int(padded.item()), world_size)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: AggNorm | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar over the unmasked tokens.

    With l_it the loss, m_it the mask, n_i = sum_t m_it, S the sequences with
    n_i > 0 (fully masked sequences are left out of every seq-mean) and T the
    padded length::

        token-mean               sum_it m_it l_it / sum_i n_i
        seq-mean-token-sum       1/|S| sum_{i in S} sum_t m_it l_it
        seq-mean-token-mean      1/|S| sum_{i in S} (sum_t m_it l_it) / n_i
        seq-mean-token-sum-norm  1/|S| sum_{i in S} (sum_t m_it l_it) / T

    With ``norm`` (from :func:`agg_norm` on the whole mini-batch), the
    numerator is this micro-batch's and the denominators (sum_i n_i, |S|, T)
    are the mini-batch's over all dp ranks; the result is multiplied by
    ``norm.world_size``. Summed over micro-batches and averaged over ranks it is
    the full mini-batch's loss, and so is its gradient. An empty mask gives 0.
    """
    _check_mode(mode)
    _check_2d(loss=loss, mask=mask)
    if norm is not None and norm.mode != mode:
        raise ValueError(f"norm was computed for mode {norm.mode!r}, not {mode!r}")
    m = mask.bool()
    token_sums = torch.where(m, loss, 0).sum(-1)
    if mode == "seq-mean-token-mean":
        n_i = m.sum(-1).to(loss.dtype)
        numerator = (token_sums / n_i.clamp(min=1)).sum()
    else:
        numerator = token_sums.sum()
    if mode == "seq-mean-token-sum-norm":
        numerator = numerator / (norm.padded_len if norm is not None else m.shape[1])

    if norm is None:
        counts = m.sum() if mode == "token-mean" else m.any(-1).sum()
        denominator = counts.to(loss.dtype)
        return numerator / torch.where(counts > 0, denominator, torch.ones_like(denominator))
    denominator = norm.tokens if mode == "token-mean" else norm.seqs
    if denominator <= 0:
        return numerator * 0.0
    return numerator * (norm.world_size / denominator)


# --------------------------------------------------------------------------- losses


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg: str = "token-mean",
    norm: AggNorm | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual-clip, aggregated by :func:`aggregate`.

    With r = exp(log_prob - old_log_prob) (log ratio bounded to +-20) and A the
    advantage, per token::

        L     = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        L     = min(L, -A clip_c)      where A < 0 (dual-clip; clip_c=None: off)

    Metrics (means over this call's unmasked tokens, Python floats):
    ``pg_clipfrac`` share of tokens where the clipped term wins,
    ``pg_clipfrac_lower`` share where the dual-clip bound wins,
    ``ppo_kl`` mean of log(old/new) (k1 estimate of KL(old || new)),
    ``approx_kl`` mean of (r - 1) - log r (k3 estimate, never negative).

    ``token_weights`` (no gradient) scale each token's loss before aggregation:
    the truncated importance weights of a rollout engine's mismatch
    (:func:`trainer.algorithms.mismatch.tis_weights`).
    """
    _check_same_shape(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    _check_mode(agg)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c (dual-clip bound) must be > 1.0 or None, got {clip_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    neg_adv = -advantages
    unclipped = neg_adv * ratio
    clipped = neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = clipped > unclipped
    dual_hit = torch.zeros_like(clip_hit)
    if clip_c is not None:
        bound = neg_adv * clip_c
        dual_hit = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    if token_weights is not None:
        _check_same_shape(token_weights=token_weights, response_mask=response_mask)
        per_token = per_token * token_weights.detach()
    loss = aggregate(per_token, response_mask, agg, norm=norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _masked_mean(clip_hit.float(), response_mask).item(),
            "pg_clipfrac_lower": _masked_mean(dual_hit.float(), response_mask).item(),
            "ppo_kl": _masked_mean(-log_ratio, response_mask).item(),
            "approx_kl": _masked_mean(ratio - 1 - log_ratio, response_mask).item(),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value regression, aggregated by :func:`aggregate`.

    With V the new values, V_old the values at rollout time and R the returns::

        V_clip = V_old + clip(V - V_old, -clip, clip)
        L      = 0.5 * max((V - R)^2, (V_clip - R)^2)      (clip=None: 0.5 (V - R)^2)

    Metrics (means over unmasked tokens): ``vf_clipfrac`` share of tokens
    where the clipped error is the larger, ``vpred_mean`` mean of V.
    """
    _check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    _check_mode(agg)
    if clip is not None and clip < 0:
        raise ValueError(f"value clip must be >= 0 or None, got {clip}")
    err = (values - returns) ** 2
    if clip is None:
        per_token = 0.5 * err
        clip_hit = torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_hit = err_clipped > err
    loss = aggregate(per_token, response_mask, agg, norm=norm)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": _masked_mean(clip_hit.float(), response_mask).item(),
            "vpred_mean": _masked_mean(values.detach(), response_mask).item(),
        }
    return loss, metrics


# --------------------------------------------------------------------------- KL and entropy


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    With d = log_prob - ref_log_prob (log pi - log pi_ref)::

        k1   d
        abs  |d|
        k2   d^2 / 2
        k3   exp(-d) - 1 + d, with d bounded to +-20 and the result to <= 10

    k3 is unbiased and never negative; its bounds stop one outlier token from
    dominating a reward or loss. Unmasked: the caller applies the mask.
    """
    _check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    d = log_prob - ref_log_prob
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        d = d.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return (torch.exp(-d) - 1 + d).clamp(max=_K3_MAX)
    raise ValueError(f"unknown KL penalty kind {kind!r}; expected one of {KL_KINDS}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    H = logsumexp(z) - sum_v softmax(z)_v z_v; tokens with probability 0
    (logit -inf) contribute 0.
    """
    probs = torch.softmax(logits, dim=-1)
    finite_logits = logits.masked_fill(probs == 0, 0)
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(-1)


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant KL coefficient beta. Same interface as :class:`AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al., 2019).

    After a batch of ``n_steps`` samples with measured KL::

        e    = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta = beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta by the proportional error of ``current_kl``, weighted by ``n_steps``."""
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
