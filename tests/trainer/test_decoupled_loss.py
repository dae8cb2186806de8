"""The corrected (decoupled) PPO loss of an engine that samples from another policy.

The clip is anchored to the actor's recomputed log-probs (``old_log_probs``,
the proximal policy); each token's loss is weighted by the capped ratio of the
proximal policy over the engine's (``rollout_log_probs``). The model is a
table of learnable logits, so every log-prob and gradient is known by hand:
d log softmax(z)[y] / dz = onehot(y) - softmax(z).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from trainer.algorithms.mismatch import importance_metrics, importance_totals, pop_totals
from trainer.workers.compute import PolicyUpdateSettings, token_log_probs, update_policy

B, P, R, V = 4, 2, 4, 5
#: Response mask: row 2 ends after one token, row 3 is a padding row.
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


class FixedLogits(torch.nn.Module):
    """Logits read from a learnable (B, P + R, V) table; the row is the first input token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids[:, 0]])


def _table(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, P + R, V, generator=torch.Generator().manual_seed(seed))


def _response_table(table: torch.Tensor) -> torch.Tensor:
    """The (B, R, V) logits that predict the response tokens."""
    return table[:, P - 1 : P + R - 1]


def _batch(table: torch.Tensor, seed: int = 1) -> TensorDict:
    """Advantages, old log-probs a little off the current ones (the clip is hit), engine = old."""
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, V, (B, R), generator=gen)
    input_ids = torch.cat([torch.arange(B)[:, None], torch.zeros(B, P - 1, dtype=torch.long)], 1)
    input_ids = torch.cat([input_ids, responses], 1)
    lp = token_log_probs(_response_table(table), responses)
    old = (lp + 0.3 * torch.randn(B, R, generator=gen)) * MASK
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones(B, P + R, dtype=torch.long),
            "position_ids": torch.arange(P + R).expand(B, -1),
            "responses": responses,
            "response_mask": MASK,
            "advantages": torch.randn(B, R, generator=gen) * MASK,
            "old_log_probs": old,
            "rollout_log_probs": old.clone(),
        },
        batch_size=[B],
    )


def _update(table: torch.Tensor, td: TensorDict, lr: float = 0.0, **settings):
    """(metrics, table after the update, gradient of the last mini-batch)."""
    model = FixedLogits(table)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    s = PolicyUpdateSettings(grad_clip=1e9, **settings)
    metrics = update_policy(model, opt, td, s)
    return metrics, model.table.detach().clone(), model.table.grad.clone()


CAPS = [
    {"tis_cap": 0.0},
    {"tis_cap": 2.0, "tis_mode": "truncate"},
    {"tis_cap": 2.0, "tis_mode": "mask"},
    {"tis_cap": 1.0, "tis_mode": "truncate"},
    {"tis_cap": 1.0, "tis_mode": "mask"},
    {"tis_cap": 2.0, "tis_level": "sequence"},
    {"tis_cap": 1.0, "tis_mode": "mask", "tis_level": "sequence"},
]


@pytest.mark.parametrize("on_policy", [False, True], ids=["old-log-prob-pass", "on-policy"])
def test_engine_equal_to_the_actor_is_the_plain_ppo_loss_exactly(on_policy):
    table = _table()
    td = _batch(table)
    schedule = {"ppo_epochs": 2, "num_mini_batches": 2, "micro_batch_size": 1, "lr": 0.5}
    if on_policy:
        del td["old_log_probs"]
        td["rollout_log_probs"] = token_log_probs(_response_table(table), td["responses"])
        schedule = {"micro_batch_size": 1, "lr": 0.5}
    plain, table_plain, grad_plain = _update(table, td.exclude("rollout_log_probs"), **schedule)
    for caps in CAPS:
        metrics, table_after, grad = _update(table, td, **schedule, **caps)
        assert metrics.pop("rollout/is_totals/tokens") == MASK.sum()
        pop_totals(metrics)
        assert metrics == plain, caps
        assert torch.equal(grad, grad_plain), caps
        assert torch.equal(table_after, table_plain), caps


# Ratios proximal / engine for the 8 response tokens, in row order; cap 2 cuts 2.5 and 4.
RATIOS = [0.25, 0.5, 1.0, 2.5, 1.5, 4.0, 2.0, 0.8]
WEIGHTS = {
    "truncate": [0.25, 0.5, 1.0, 2.0, 1.5, 2.0, 2.0, 0.8],
    "mask": [0.25, 0.5, 1.0, 0.0, 1.5, 0.0, 2.0, 0.8],
}


def _off_engine_batch(table: torch.Tensor) -> TensorDict:
    """Old log-probs equal the current ones (PPO ratio 1); the engine's differ by RATIOS."""
    td = _batch(table)
    m = MASK.bool()
    td["old_log_probs"] = token_log_probs(_response_table(table), td["responses"]) * MASK
    engine = td["old_log_probs"].clone()
    engine[m] -= torch.log(torch.tensor(RATIOS))
    td["rollout_log_probs"] = engine
    return td


def _hand_gradient(table: torch.Tensor, td: TensorDict, weights: list[float]) -> torch.Tensor:
    """d/dz of token-mean(-A w r) at r = 1: -A w (onehot(y) - softmax(z)) / N per response token."""
    m = MASK.bool()
    w = torch.zeros(B, R)
    w[m] = torch.tensor(weights)
    z = _response_table(table)
    d_logp = torch.nn.functional.one_hot(td["responses"], V) - torch.softmax(z, -1)
    grad = torch.zeros_like(table)
    grad[:, P - 1 : P + R - 1] = -(td["advantages"] * w)[..., None] * d_logp / m.sum()
    return grad


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_the_cap_weights_the_loss_and_the_gradient_by_hand(mode):
    table = _table()
    td = _off_engine_batch(table)
    metrics, _, grad = _update(table, td, tis_cap=2.0, tis_mode=mode)
    m = MASK.bool()
    w = torch.tensor(WEIGHTS[mode])
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(td["advantages"][m] * w).mean()))
    torch.testing.assert_close(grad, _hand_gradient(table, td, WEIGHTS[mode]))
    if mode == "mask":  # exactly the tokens over the cap have no gradient at all
        dead = torch.zeros(B, R, dtype=torch.bool)
        dead[m] = torch.tensor(RATIOS) > 2.0
        assert (_response_table(grad)[dead] == 0).all()
        assert (_response_table(grad)[~dead & m] != 0).any(-1).all()
    got = importance_metrics(pop_totals(metrics))
    assert got == pytest.approx(
        {
            "rollout/is_weight_mean": sum(RATIOS) / 8,
            "rollout/is_weight_max": 4.0,
            "rollout/is_truncated_frac": 2 / 8,
            "rollout/is_ess": sum(WEIGHTS[mode]) ** 2 / (8 * sum(x * x for x in WEIGHTS[mode])),
        },
        rel=1e-5,
    )


# The same ratios per response: row 0 0.25 * 0.5 * 1 * 2.5, row 1 1.5 * 4 * 2, row 2 0.8.
SEQUENCE_RATIOS = [0.3125] * 4 + [12.0] * 3 + [0.8]
SEQUENCE_WEIGHTS = {
    "truncate": [0.3125] * 4 + [2.0] * 3 + [0.8],
    "mask": [0.3125] * 4 + [0.0] * 3 + [0.8],
}


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_the_sequence_level_weight_is_the_response_ratio_capped_by_hand(mode):
    table = _table()
    td = _off_engine_batch(table)
    metrics, _, grad = _update(table, td, tis_cap=2.0, tis_mode=mode, tis_level="sequence")
    m = MASK.bool()
    w = torch.tensor(SEQUENCE_WEIGHTS[mode])
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(td["advantages"][m] * w).mean()))
    torch.testing.assert_close(grad, _hand_gradient(table, td, SEQUENCE_WEIGHTS[mode]))
    got = importance_metrics(pop_totals(metrics))
    weights = SEQUENCE_WEIGHTS[mode]
    assert got == pytest.approx(
        {
            "rollout/is_weight_mean": sum(SEQUENCE_RATIOS) / 8,
            "rollout/is_weight_max": 12.0,
            "rollout/is_truncated_frac": 3 / 8,
            "rollout/is_ess": sum(weights) ** 2 / (8 * sum(x * x for x in weights)),
        },
        rel=1e-5,
    )


def test_without_a_cap_the_weights_are_reported_not_applied():
    table = _table()
    td = _off_engine_batch(table)
    metrics, _, grad = _update(table, td)
    torch.testing.assert_close(grad, _hand_gradient(table, td, [1.0] * 8))
    got = importance_metrics(pop_totals(metrics))
    assert got["rollout/is_truncated_frac"] == 0.0
    assert got["rollout/is_weight_max"] == pytest.approx(4.0)
    assert got["rollout/is_ess"] == pytest.approx(
        sum(RATIOS) ** 2 / (8 * sum(x * x for x in RATIOS))
    )


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_padding_has_no_weight(mode):
    table = _table()
    td = _off_engine_batch(table)
    before = _update(table, td, tis_cap=2.0, tis_mode=mode, micro_batch_size=2)
    pad = ~MASK.bool()
    junk = torch.tensor([30.0, -1e4, float("nan"), float("-inf")]).repeat(pad.sum() // 4 + 1)
    changed = td.clone()
    changed["rollout_log_probs"][pad] = junk[: int(pad.sum())]
    changed_table = table.clone()
    _response_table(changed_table)[pad] = 50 * torch.randn(int(pad.sum()), V)
    after = _update(changed_table, changed, tis_cap=2.0, tis_mode=mode, micro_batch_size=2)
    assert after[0] == before[0]  # loss, every actor/ metric, the totals
    assert torch.equal(after[2], before[2])
    assert (_response_table(after[2])[pad] == 0).all()


def _ess(weights: list[float], mask: list[int]) -> float:
    w = torch.tensor([weights])
    m = torch.tensor([mask])
    return importance_metrics(importance_totals(w, w, m, 0.0))["rollout/is_ess"]


def test_effective_sample_size_of_hand_made_weights():
    assert _ess([0.7] * 6, [1] * 6) == pytest.approx(1.0)
    assert _ess([0, 0, 3.0, 0, 0, 0], [1] * 6) == pytest.approx(1 / 6)
    assert _ess([1.0, 3.0], [1, 1]) == pytest.approx(16 / 20)
    # Padding is not one of the N tokens, whatever its weight.
    assert _ess([0.7, 0.7, 0.7, 9.0], [1, 1, 1, 0]) == pytest.approx(1.0)
    assert _ess([0.0, 0.0], [1, 1]) == 0.0
    assert importance_metrics(importance_totals(*[torch.zeros(1, 2)] * 3, 0.0)) == {}


def test_update_policy_reports_the_weights_and_ranks_combine():
    """Two "ranks" (half the rows each, micro-batches of one row, two epochs) equal one."""
    from trainer.algorithms.mismatch import TOTALS_REDUCE
    from trainer.data import batch as batch_ops

    table = _table()
    td = _off_engine_batch(table)
    settings = {"tis_cap": 2.0, "ppo_epochs": 2, "micro_batch_size": 1}
    whole, _, _ = _update(table, td, **settings)
    per_rank = [_update(table, td[rows], **settings)[0] for rows in (slice(0, 2), slice(2, 4))]
    reduce = {k: v for k, v in TOTALS_REDUCE.items() if k in per_rank[0]}
    merged = pop_totals(batch_ops.merge_metrics(per_rank, reduce=reduce))
    totals = pop_totals(whole)
    assert totals["rollout/is_totals/tokens"] == 8  # each token once, not once per epoch
    assert importance_metrics(merged) == pytest.approx(importance_metrics(totals))
    assert importance_metrics(totals)["rollout/is_truncated_frac"] == 2 / 8
    assert importance_metrics(totals)["rollout/is_weight_mean"] == pytest.approx(
        sum(RATIOS) / 8, rel=1e-6
    )
    assert math.isclose(importance_metrics(totals)["rollout/is_weight_max"], 4.0, rel_tol=1e-6)


def test_a_cap_without_engine_log_probs_is_refused():
    table = _table()
    td = _batch(table).exclude("rollout_log_probs")
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        _update(table, td, tis_cap=2.0)
