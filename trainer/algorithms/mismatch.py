"""How far the rollout engine's policy is from the actor's, token by token, and its correction.

An engine that holds its own copy of the weights (vLLM) returns the log-prob
it gave each token it sampled (``rollout_log_probs``). The actor scores the
same tokens in its old-log-prob pass, or in the update's own forward when the
update is one on-policy pass. With the weights in sync the two differ only by
kernels (float rounding); a missed or wrong weight push shows up at once as a
large gap, which is why the gap is reported every step
(``rollout/actor_logprob_diff_mean``, ``_max``, ``rollout/actor_prob_diff_mean``
and ``rollout/actor_prob_diff_gt_0.1``, verl's names where verl has one).

The correction is decoupled PPO: the clip is taken against the actor's own
(proximal) log-probs of the batch, and each token's clipped loss is weighted
by the importance ratio pi_proximal / pi_rollout of the policy the clip is
anchored to over the engine's policy that sampled, capped at ``tis_cap``
(:func:`importance_ratios`, :func:`cap_weights`). The ratio is the token's own
(``level="token"``) or its whole response's, the product of the token ratios
(``level="sequence"``), which also reweights the prefix the token was sampled
after and the continuation its reward came from. Its health is reported every
step the batch carries the engine's log-probs (``rollout/is_weight_mean``,
``rollout/is_weight_max``, ``rollout/is_truncated_frac``, ``rollout/is_ess``).

Both families of statistics are carried as sums (and a max) so that
data-parallel ranks and micro-batches combine exactly: :func:`mismatch_totals`
and :func:`importance_totals` per piece, :func:`add_totals` within a rank,
``merge_metrics`` with :data:`TOTALS_REDUCE` across ranks, :func:`pop_totals`,
then :func:`mismatch_metrics` and :func:`importance_metrics` once.
"""

from __future__ import annotations

import torch

__all__ = [
    "PROB_GAP",
    "TIS_LEVELS",
    "TIS_MODES",
    "TOTALS_REDUCE",
    "add_totals",
    "cap_weights",
    "importance_metrics",
    "importance_ratios",
    "importance_totals",
    "mismatch_by_lag",
    "mismatch_metrics",
    "mismatch_totals",
    "pop_totals",
    "tis_weights",
]

#: A token counts as mismatched when its probability differs by more than this.
PROB_GAP = 0.1

#: ``rollout.tis_mode``: how the cap applies to a ratio above it.
TIS_MODES = ("truncate", "mask")
#: ``rollout.tis_level``: whose ratio weighs a token, its own or its response's.
TIS_LEVELS = ("token", "sequence")
# Bound on log(pi_actor / pi_rollout) before exp(): a ratio stays finite.
_LOG_RATIO_MAX = 20.0

_PREFIX = "rollout/mismatch_totals/"
_SUMS = ("abs_logp", "abs_prob", "over_gap", "tokens")
_IS_PREFIX = "rollout/is_totals/"
_IS_SUMS = ("ratio", "weight", "weight_sq", "truncated", "tokens")
#: How each total combines across ranks (``trainer.data.batch.merge_metrics``'s ``reduce``).
TOTALS_REDUCE = {
    **{_PREFIX + k: "sum" for k in _SUMS},
    _PREFIX + "max_abs_logp": "max",
    **{_IS_PREFIX + k: "sum" for k in _IS_SUMS},
    _IS_PREFIX + "max_ratio": "max",
}


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        got = ", ".join(str(s) for s in shapes.values())
        raise ValueError(f"{', '.join(shapes)} must have one shape, got {got}")


def mismatch_totals(
    actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Sums over the response tokens of one piece of a batch (all (B, R))."""
    _check_shapes(
        actor_log_probs=actor_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    m = response_mask.bool()
    actor = actor_log_probs.detach().float()[m]
    rollout = rollout_log_probs.detach().to(actor.device).float()[m]
    d_logp = (actor - rollout).abs()
    d_prob = (actor.exp() - rollout.exp()).abs()
    return {
        _PREFIX + "abs_logp": float(d_logp.sum()),
        _PREFIX + "abs_prob": float(d_prob.sum()),
        _PREFIX + "over_gap": float((d_prob > PROB_GAP).sum()),
        _PREFIX + "tokens": float(m.sum()),
        _PREFIX + "max_abs_logp": float(d_logp.max()) if d_logp.numel() else 0.0,
    }


def add_totals(acc: dict[str, float], piece: dict[str, float]) -> dict[str, float]:
    """``acc`` with ``piece`` added in (sums summed, the max kept); ``acc`` may be empty."""
    out = dict(acc)
    for key, value in piece.items():
        if key not in out:
            out[key] = value
        elif TOTALS_REDUCE[key] == "max":
            out[key] = max(out[key], value)
        else:
            out[key] += value
    return out


def pop_totals(metrics: dict[str, float]) -> dict[str, float]:
    """Remove the totals (mismatch and importance weights) from a merged metrics dict.

    Returns them, empty when absent. :func:`mismatch_metrics` and
    :func:`importance_metrics` each read their own family from the result.
    """
    return {k: metrics.pop(k) for k in list(metrics) if k in TOTALS_REDUCE}


def mismatch_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The reported means and max from combined totals; empty when no token was compared."""
    tokens = totals.get(_PREFIX + "tokens", 0.0)
    if tokens <= 0:
        return {}
    return {
        "rollout/actor_logprob_diff_mean": totals[_PREFIX + "abs_logp"] / tokens,
        "rollout/actor_logprob_diff_max": totals[_PREFIX + "max_abs_logp"],
        "rollout/actor_prob_diff_mean": totals[_PREFIX + "abs_prob"] / tokens,
        f"rollout/actor_prob_diff_gt_{PROB_GAP}": totals[_PREFIX + "over_gap"] / tokens,
    }


def importance_ratios(
    actor_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    level: str = "token",
) -> torch.Tensor:
    """``pi_actor / pi_rollout`` per token, no gradient; 0 at padding (``response_mask`` 0).

    ``exp(min(log pi_actor - log pi_rollout, 20))``: a ratio is finite. The
    actor's log-probs are the proximal policy's (the old-log-prob pass, or the
    update's own forward, detached, for one on-policy pass); the engine's are
    the behaviour policy's, the one that sampled the tokens. Whatever sits at
    a padding position (even a NaN) gives weight 0 there.

    ``level="sequence"`` gives every token of a row the row's ratio,
    ``exp(min(sum_t log pi_actor - log pi_rollout, 20))`` over its response
    tokens (verl's ``rollout_is_level=sequence``; needs ``response_mask``).
    With a reward on the last token, the token ratio corrects only the token's
    own probability: the prefix it follows and the continuation that earned
    the reward stay the engine's. The product reweights the whole response, so
    before the cap the weighted loss is the proximal policy's own PPO loss;
    it varies more as responses grow longer.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown tis_level {level!r}; expected one of {TIS_LEVELS}")
    log_ratio = actor_log_probs.detach() - rollout_log_probs.detach().to(actor_log_probs.device)
    if level == "sequence":
        if response_mask is None:
            raise ValueError("tis_level='sequence' needs the response mask")
        m = response_mask.bool()
        log_ratio = torch.where(m, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
        log_ratio = log_ratio.expand_as(m)
    ratios = log_ratio.clamp(max=_LOG_RATIO_MAX).exp()
    if response_mask is None:
        return ratios
    return torch.where(response_mask.bool(), ratios, torch.zeros_like(ratios))


def cap_weights(ratios: torch.Tensor, cap: float, mode: str = "truncate") -> torch.Tensor:
    """The importance weights of the corrected loss from the ratios, with the cap ``C``::

        truncate   w = min(r, C)
        mask       w = r if r <= C else 0

    Truncation keeps every token with a bounded weight (variance bounded,
    some bias); masking drops the tokens the engine found much less likely
    than the actor does and keeps the others unbiased. With all ratios 1 and
    ``C >= 1`` both give 1: the plain PPO loss.
    """
    if cap <= 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}")
    if mode == "truncate":
        return ratios.clamp(max=cap)
    if mode == "mask":
        return torch.where(ratios > cap, torch.zeros_like(ratios), ratios)
    raise ValueError(f"unknown tis_mode {mode!r}; expected one of {TIS_MODES}")


def tis_weights(
    actor_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    cap: float,
    mode: str = "truncate",
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Capped importance weights per token, no gradient: :func:`cap_weights` of :func:`importance_ratios`.

    The samples came from the engine's policy, the loss assumes the actor's:
    weighting each token's policy loss by this ratio corrects the difference,
    and the cap bounds the variance a rare large ratio would add (TRL's
    ``vllm_importance_sampling_correction``, verl's TIS).
    """
    return cap_weights(
        importance_ratios(actor_log_probs, rollout_log_probs, response_mask), cap, mode
    )


def importance_totals(
    ratios: torch.Tensor, weights: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """Sums over the response tokens of one piece: the ratios before the cap, the weights after it.

    ``weights`` are the ones applied (or the ratios themselves when no cap is
    applied, ``cap`` 0: then nothing counts as truncated). A token counts as
    truncated (or masked) when its ratio exceeds ``cap > 0``.
    """
    _check_shapes(ratios=ratios, weights=weights, response_mask=response_mask)
    m = response_mask.bool()
    r = ratios.detach().double()[m]
    w = weights.detach().to(r.device).double()[m]
    truncated = float((r > cap).sum()) if cap > 0 else 0.0
    return {
        _IS_PREFIX + "ratio": float(r.sum()),
        _IS_PREFIX + "weight": float(w.sum()),
        _IS_PREFIX + "weight_sq": float(w.square().sum()),
        _IS_PREFIX + "truncated": truncated,
        _IS_PREFIX + "tokens": float(m.sum()),
        _IS_PREFIX + "max_ratio": float(r.max()) if r.numel() else 0.0,
    }


def importance_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The importance weights' health from combined totals; empty when no token was weighted.

    Over the N response tokens, r the ratio before the cap and w the weight
    after it::

        rollout/is_weight_mean     sum r / N            (near 1 when healthy)
        rollout/is_weight_max      max r
        rollout/is_truncated_frac  #{r > cap} / N
        rollout/is_ess             (sum w)^2 / (N sum w^2), in [0, 1]

    The ESS is 1 when all weights are equal and 1/N when one token carries
    them all; 0 when every weight is 0.
    """
    n = totals.get(_IS_PREFIX + "tokens", 0.0)
    if n <= 0:
        return {}
    w_sum, w_sq = totals[_IS_PREFIX + "weight"], totals[_IS_PREFIX + "weight_sq"]
    return {
        "rollout/is_weight_mean": totals[_IS_PREFIX + "ratio"] / n,
        "rollout/is_weight_max": totals[_IS_PREFIX + "max_ratio"],
        "rollout/is_truncated_frac": totals[_IS_PREFIX + "truncated"] / n,
        "rollout/is_ess": w_sum * w_sum / (n * w_sq) if w_sq > 0 else 0.0,
    }


def mismatch_by_lag(
    actor_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    lag: torch.Tensor,
) -> dict[str, float]:
    """Mean |log pi_actor - log pi_rollout| over the response tokens of the rows of each lag.

    ``lag`` (B,) integers: how many policy versions the actor is ahead of the
    one that generated each row. Returns
    ``rollout/actor_logprob_diff_mean/lag{L}`` for each lag L whose rows have
    at least one response token. Lag 0 is the numeric mismatch alone (kernels,
    precision); the growth with L is what staleness adds.
    """
    _check_shapes(
        actor_log_probs=actor_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    rows = actor_log_probs.shape[0]
    if lag.dim() != 1 or lag.shape[0] != rows:
        raise ValueError(f"lag must have shape ({rows},), got {tuple(lag.shape)}")
    if lag.is_floating_point() or lag.is_complex() or lag.dtype == torch.bool:
        raise ValueError(f"lag must hold integers, got {lag.dtype}")
    if bool((lag < 0).any()):
        raise ValueError(f"lag must be >= 0, got {sorted(set(lag.tolist()))}")
    m = response_mask.bool()
    actor = actor_log_probs.detach().double()
    gap = torch.where(m, (actor - rollout_log_probs.detach().to(actor).double()).abs(), 0)
    lag = lag.to(gap.device)
    out = {}
    for value in sorted(set(lag.tolist())):
        rows_of = lag == value
        tokens = int(m[rows_of].sum())
        if tokens:
            out[f"rollout/actor_logprob_diff_mean/lag{value}"] = float(gap[rows_of].sum()) / tokens
    return out
