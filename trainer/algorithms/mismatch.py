"""How far the rollout engine's policy is from the actor's, token by token, and its correction.

An engine that holds its own copy of the weights (vLLM) returns the log-prob
it gave each token it sampled (``rollout_log_probs``). The actor scores the
same tokens in its old-log-prob pass, or in the update's own forward when the
update is one on-policy pass. With the weights in sync the two differ only by
kernels (float rounding); a missed or wrong weight push shows up at once as a
large gap, which is why the gap is reported every step
(``rollout/actor_logprob_diff_mean``, ``_max``, ``rollout/actor_prob_diff_mean``
and ``rollout/actor_prob_diff_gt_0.1``, verl's names where verl has one).

The statistics are carried as sums (and a max) so that data-parallel ranks and
micro-batches combine exactly: :func:`mismatch_totals` per piece,
``merge_metrics`` with :data:`TOTALS_REDUCE` across ranks, then
:func:`mismatch_metrics` once.
"""

from __future__ import annotations

import torch

__all__ = [
    "PROB_GAP",
    "TOTALS_REDUCE",
    "add_totals",
    "mismatch_metrics",
    "mismatch_totals",
    "pop_totals",
    "tis_weights",
]

#: A token counts as mismatched when its probability differs by more than this.
PROB_GAP = 0.1

_PREFIX = "rollout/mismatch_totals/"
_SUMS = ("abs_logp", "abs_prob", "over_gap", "tokens")
#: How each total combines across ranks (``trainer.data.batch.merge_metrics``'s ``reduce``).
TOTALS_REDUCE = {**{_PREFIX + k: "sum" for k in _SUMS}, _PREFIX + "max_abs_logp": "max"}


def mismatch_totals(
    actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Sums over the response tokens of one piece of a batch (all (B, R))."""
    if not actor_log_probs.shape == rollout_log_probs.shape == response_mask.shape:
        raise ValueError(
            "actor_log_probs, rollout_log_probs and response_mask must have one shape, got "
            f"{tuple(actor_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, "
            f"{tuple(response_mask.shape)}"
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
    """Remove the totals from a merged metrics dict and return them (empty when absent)."""
    return {k: metrics.pop(k) for k in list(metrics) if k.startswith(_PREFIX)}


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


def tis_weights(
    actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``min(pi_actor / pi_rollout, cap)`` per token, no gradient.

    The samples came from the engine's policy, the loss assumes the actor's:
    weighting each token's policy loss by this ratio corrects the difference,
    and the cap bounds the variance a rare large ratio would add (TRL's
    ``vllm_importance_sampling_correction``, verl's TIS).
    """
    if cap <= 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}")
    log_ratio = (actor_log_probs.detach() - rollout_log_probs.to(actor_log_probs.device)).clamp(
        max=20.0
    )
    return log_ratio.exp().clamp(max=cap)
