"""The workers' update math: global aggregation over micro-batches and real gloo ranks.

A PPO (and value) update over a batch split across 2 data-parallel gloo ranks
with several micro-batches each must give the same parameters as 1 process
with no micro-batching. Padding rows (zero response mask) must change nothing.
"""

from __future__ import annotations

import pytest
import torch
from deadlines import hang_guard
from tensordict import TensorDict

from rl_e2e.distributed import run_distributed
from trainer.loop.ppo import pad_for_update
from trainer.models import ensure_tiny_model
from trainer.rollout import finish_responses
from trainer.workers.compute import (
    PolicyUpdateSettings,
    ValueUpdateSettings,
    compute_log_probs,
    compute_values,
    update_policy,
    update_value,
)
from trainer.workers.setup import build_actor, build_critic

R = 4


def build_optimizer(model, _unused=None):
    """SGD: the comparison is about gradients; Adam would amplify float32 rounding
    in near-zero gradient entries (g / sqrt(v)) far past any tolerance."""
    return torch.optim.SGD(model.parameters(), lr=0.05), None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _batch(model_dir: str, rows: int, seed: int) -> TensorDict:
    """A rollout-shaped batch with random responses of varied length, one fully masked row."""
    gen = torch.Generator().manual_seed(seed)
    prompt_len = 5
    prompts = torch.randint(7, 20, (rows, prompt_len), generator=gen)
    pmask = torch.ones(rows, prompt_len, dtype=torch.long)
    pmask[0, :2] = 0  # one left-padded prompt
    responses = torch.randint(7, 20, (rows, R), generator=gen)
    lengths = torch.randint(1, R + 1, (rows,), generator=gen)
    for i, n in enumerate(lengths.tolist()):
        if n < R:
            responses[i, n] = 2  # EOS
    td = finish_responses(prompts, pmask, responses, R, eos_token_id=2, pad_token_id=0)
    actor = build_actor(model_dir)
    td["old_log_probs"], _ = compute_log_probs(actor, td, 1.0, 64)
    td["old_log_probs"] += 0.05 * torch.randn(rows, R, generator=gen)  # off-policy: ratios != 1
    td["advantages"] = torch.randn(rows, R, generator=gen) * td["response_mask"]
    td["ref_log_probs"] = td["old_log_probs"] - 0.1
    critic = build_critic(model_dir, seed=0)
    td["values"] = compute_values(critic, td, 64) + 0.1 * torch.randn(rows, R, generator=gen)
    td["returns"] = torch.randn(rows, R, generator=gen)
    return td


def _policy_settings(mode: str, micro: int) -> PolicyUpdateSettings:
    return PolicyUpdateSettings(
        ppo_epochs=2,
        num_mini_batches=2,
        micro_batch_size=micro,
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        grad_clip=1e9,
        shuffle_seed=3,
    )


def _train(
    model_dir: str, td: TensorDict, mode: str, micro: int, group=None
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    actor = build_actor(model_dir)
    opt, _ = build_optimizer(actor)
    metrics = update_policy(actor, opt, td, _policy_settings(mode, micro), group)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    critic = build_critic(model_dir, seed=0)
    copt, _ = build_optimizer(critic)
    vs = ValueUpdateSettings(
        ppo_epochs=1, num_mini_batches=2, micro_batch_size=micro, loss_agg_mode=mode, grad_clip=1e9
    )
    update_value(critic, copt, td, vs, group)
    out = {f"actor.{k}": v.detach().clone() for k, v in actor.state_dict().items()}
    out.update({f"critic.{k}": v.detach().clone() for k, v in critic.state_dict().items()})
    return out


def _rank_train(rank: int, world_size: int, model_dir: str, td: TensorDict, mode: str) -> dict:
    torch.set_num_threads(1)
    shard = td.split(td.batch_size[0] // world_size)[rank]
    return _train(model_dir, shard, mode, micro=3)


def _assert_close(a: dict, b: dict) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(model_dir, mode):
    td = _batch(model_dir, rows=12, seed=1)
    _assert_close(_train(model_dir, td, mode, micro=12), _train(model_dir, td, mode, micro=5))


def test_padding_rows_change_nothing(model_dir):
    td = _batch(model_dir, rows=10, seed=2)
    padded = pad_for_update(td, 4)
    assert padded.batch_size[0] == 12 and padded["response_mask"][10:].sum() == 0
    # 1 mini-batch so the shuffle cannot put real rows in different mini-batches.
    s = PolicyUpdateSettings(
        num_mini_batches=1,
        micro_batch_size=5,
        loss_agg_mode="seq-mean-token-mean",
        use_kl_loss=True,
        kl_loss_coef=0.1,
    )
    outs = []
    for batch in (td, padded):
        torch.manual_seed(0)
        actor = build_actor(model_dir)
        opt, _ = build_optimizer(actor)
        update_policy(actor, opt, batch, s)
        outs.append(actor.state_dict())
    _assert_close(outs[0], outs[1])


@pytest.mark.parametrize("mode", ["seq-mean-token-mean"])
def test_two_gloo_ranks_with_micro_batches_equal_one_process(model_dir, mode):
    """2 ranks x micro-batches of 3 == 1 process, whole mini-batches (1e-5 relative).

    Each rank's mini-batches are a seeded shuffle of its own rows, so to compare
    with one process the single-process batch is built as the concatenation of
    what the two ranks' shuffles select for each mini-batch.
    """
    td = _batch(model_dir, rows=16, seed=3)
    td["response_mask"][5] = 0  # a fully masked row on rank 0 (like driver padding)
    td["advantages"][5] = 0
    per_rank = run_distributed(
        _rank_train, 2, model_dir, td, mode, backend="gloo", timeout_s=hang_guard(120)
    )
    _assert_close(per_rank[0], per_rank[1])  # ranks stay in sync
    # Single process: same mini-batches = union of each rank's mini-batch k.
    from trainer.workers.compute import _mini_batches

    shards = td.split(8)
    s = _policy_settings(mode, 3)
    single_epochs = []
    for epoch in range(s.ppo_epochs):
        parts = [
            _mini_batches(sh, s.num_mini_batches, s.shuffle_seed * 1000 + epoch) for sh in shards
        ]
        single_epochs.append(
            [torch.cat([parts[0][k], parts[1][k]]) for k in range(s.num_mini_batches)]
        )
    torch.manual_seed(0)
    actor = build_actor(model_dir)
    opt, _ = build_optimizer(actor)
    s1 = PolicyUpdateSettings(
        **{**s.__dict__, "num_mini_batches": 1, "ppo_epochs": 1, "micro_batch_size": 1000}
    )
    for epoch in single_epochs:
        for mini in epoch:
            update_policy(actor, opt, mini, s1)
    critic = build_critic(model_dir, seed=0)
    copt, _ = build_optimizer(critic)
    vparts = [_mini_batches(sh, 2, 0) for sh in shards]
    vs1 = ValueUpdateSettings(
        num_mini_batches=1, micro_batch_size=1000, loss_agg_mode=mode, grad_clip=1e9
    )
    for k in range(2):
        update_value(critic, copt, torch.cat([vparts[0][k], vparts[1][k]]), vs1)
    single = {f"actor.{k}": v for k, v in actor.state_dict().items()}
    single.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    _assert_close(per_rank[0], single)


def test_one_on_policy_pass_without_old_log_probs_is_the_same_update(model_dir):
    """Skipping the old-log-prob pass: the update's own log-probs, detached, are the old ones."""
    td = _batch(model_dir, rows=8, seed=4)
    s = PolicyUpdateSettings(num_mini_batches=1, micro_batch_size=3, grad_clip=1e9)
    torch.manual_seed(0)
    actor = build_actor(model_dir)
    td["old_log_probs"], entropy = compute_log_probs(actor, td, 1.0, 64)  # exactly on-policy
    outs, metrics = [], []
    for batch in (td, td.exclude("old_log_probs")):
        torch.manual_seed(0)
        actor = build_actor(model_dir)
        opt, _ = build_optimizer(actor)
        metrics.append(update_policy(actor, opt, batch, s))
        outs.append(actor.state_dict())
    _assert_close(outs[0], outs[1])
    assert metrics[1]["actor/pg_clipfrac"] == 0.0 and metrics[1]["actor/approx_kl"] == 0.0
    # The entropy the skipped pass would have reported (mean over micro-batches here).
    assert metrics[1]["actor/entropy"] == pytest.approx(
        float(entropy[td["response_mask"].bool()].mean()), rel=0.05
    )
    with pytest.raises(ValueError, match=r"only valid for one on-policy pass .*ppo_epochs=2"):
        update_policy(actor, opt, td.exclude("old_log_probs"), _policy_settings("token-mean", 4))


def test_micro_batches_by_token_budget():
    from trainer.workers.compute import micro_batches

    td = TensorDict({"input_ids": torch.zeros(10, 20, dtype=torch.long)}, batch_size=[10])
    assert [m.batch_size[0] for m in micro_batches(td, 0, 64)] == [3, 3, 3, 1]  # 64 // 20 rows
    assert [m.batch_size[0] for m in micro_batches(td, 0, 5)] == [1] * 10  # at least one row
    assert [m.batch_size[0] for m in micro_batches(td, 4, 5)] == [4, 4, 2]  # rows win when set
    with pytest.raises(ValueError, match="give rows >= 1 or tokens >= 1"):
        micro_batches(td, 0, 0)


def test_the_old_log_prob_pass_is_skipped_only_for_one_on_policy_pass():
    from trainer.config import load_config
    from trainer.loop.ppo import needs_old_log_prob_pass

    one = ["actor.ppo_epochs=1", "actor.ppo_mini_batch_size=128", "data.train_batch_size=128"]
    assert not needs_old_log_prob_pass(load_config(["algo=grpo", *one]))
    assert needs_old_log_prob_pass(load_config(["algo=grpo"]))  # 2 epochs of 2 mini-batches
    assert needs_old_log_prob_pass(load_config(["algo=grpo", *one[1:]]))  # 2 epochs
    kl = ["algorithm.use_kl_in_reward=true"]
    assert needs_old_log_prob_pass(load_config(["algo=grpo", *one, *kl]))
