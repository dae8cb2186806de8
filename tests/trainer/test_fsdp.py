"""The FSDP2 engine on real gloo ranks (CPU): the same code path GPU runs use.

One 2-rank run (spawned processes, one process group) does everything that
needs the group, and returns what the test process checks against a plain,
unsharded, single-process model:

- update equivalence: 2 sharded ranks, each with half the batch in
  micro-batches, end with the parameters of 1 process on the whole batch,
  with and without the shared-prompt forward;
- generation and scoring inside :func:`gathered_for_inference` with a
  different number of forwards per rank (would deadlock without it);
- full state dict (and the sharded checkpoint, read back whole) load into a plain HF model that
  then gives the sharded model's logits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from deadlines import hang_guard
from tensordict import TensorDict

from rl_e2e.distributed import run_distributed
from trainer import fsdp
from trainer.models import ensure_tiny_model
from trainer.rollout import finish_responses
from trainer.workers.compute import (
    PolicyUpdateSettings,
    compute_log_probs,
    response_logits,
    update_policy,
)
from trainer.workers.setup import build_actor

R = 4
ROWS = 12
SETTINGS = PolicyUpdateSettings(
    ppo_epochs=2,
    num_mini_batches=1,  # 1 mini-batch: the shuffle cannot differ between 1 and 2 ranks
    micro_batch_size=3,
    loss_agg_mode="seq-mean-token-mean",
    entropy_coeff=0.01,
    grad_clip=1e9,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _batch(model_dir: str) -> TensorDict:
    """A rollout-shaped batch: varied response lengths, one left-padded prompt, off-policy.

    Each prompt is drawn twice (GRPO-shaped), so the shared-prompt update has
    prompts to share on each rank's half.
    """
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(7, 20, (ROWS // 2, 5), generator=gen).repeat_interleave(2, 0)
    pmask = torch.ones(ROWS, 5, dtype=torch.long)
    pmask[:2, :2] = 0
    responses = torch.randint(7, 20, (ROWS, R), generator=gen)
    for i, n in enumerate(torch.randint(1, R + 1, (ROWS,), generator=gen).tolist()):
        if n < R:
            responses[i, n] = 2
    td = finish_responses(prompts, pmask, responses, R, eos_token_id=2, pad_token_id=0)
    td["old_log_probs"], _ = compute_log_probs(build_actor(model_dir), td, 1.0, 64)
    td["old_log_probs"] += 0.05 * torch.randn(ROWS, R, generator=gen)
    td["advantages"] = torch.randn(ROWS, R, generator=gen) * td["response_mask"]
    return td


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD: Adam would amplify float32 rounding of near-zero gradients past any tolerance.
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def _rank_main(rank: int, world: int, model_dir: str, td: TensorDict, ckpt_dir: str) -> dict:
    from trainer.workers.state import CheckpointSaver, load_training_state

    torch.set_num_threads(1)
    model = fsdp.shard_model(build_actor(model_dir), torch.device("cpu"))
    assert fsdp.is_sharded(model) and len(fsdp.decoder_layers(model)) == 2
    opt = _sgd(model)
    shard = td.split(ROWS // world)[rank]
    metrics = update_policy(model, opt, shard, SETTINGS)
    full = fsdp.full_state_dict(model)

    # Uneven work per rank: rank 1 generates more tokens and scores in more micro-batches.
    with fsdp.gathered_for_inference(model):
        out = model.generate(
            input_ids=td["prompts"][:2],
            attention_mask=torch.ones(2, 5, dtype=torch.long),
            max_new_tokens=2 + 4 * rank,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        lp, _ = compute_log_probs(model, td, 1.0, micro_batch_size=4 + 4 * rank)
    with fsdp.gathered_for_inference(model), torch.no_grad():
        logits = response_logits(model, td, 1.0)

    CheckpointSaver("actor", rank).save(ckpt_dir, model, opt, None)
    update_policy(model, opt, shard, SETTINGS)  # move away from the saved state...
    load_training_state(ckpt_dir, "actor", rank, model, opt, None)  # ...and back
    restored = fsdp.full_state_dict(model)

    # The shared-prompt update: two forwards per micro-batch on every rank, one backward.
    shared = fsdp.shard_model(build_actor(model_dir), torch.device("cpu"))
    update_policy(shared, _sgd(shared), shard, replace(SETTINGS, share_prompt=True))
    return {
        "shared": fsdp.full_state_dict(shared),
        "metrics": metrics,
        "full": full,
        "restored": restored,
        "generated": out.shape[1] - 5,
        "log_probs": lp,
        "logits": logits,
    }


@pytest.fixture(scope="module")
def fsdp_run(model_dir, tmp_path_factory):
    """The batch, each rank's results, and the checkpoint directory of one 2-rank run."""
    td = _batch(model_dir)
    ckpt = tmp_path_factory.mktemp("ckpt")
    out = run_distributed(
        _rank_main, 2, model_dir, td, str(ckpt), backend="gloo", timeout_s=hang_guard(150)
    )
    return td, out, ckpt


def test_fsdp2_on_two_gloo_ranks_matches_one_plain_process(model_dir, fsdp_run):
    td, out, _ = fsdp_run

    torch.manual_seed(0)
    plain = build_actor(model_dir)
    update_policy(plain, _sgd(plain), td, SETTINGS)
    expected = plain.state_dict()
    for rank in (0, 1):
        assert all(torch.isfinite(torch.tensor(v)) for v in out[rank]["metrics"].values())
    assert out[1]["full"] == {}, "the full state dict is gathered to rank 0 only"
    assert set(out[0]["full"]) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(
            out[0]["full"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )
        torch.testing.assert_close(
            out[0]["shared"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"shared {k}: {m}"
        )
    moved = max(
        (out[0]["full"][k] - build_actor(model_dir).state_dict()[k]).abs().max() for k in expected
    )
    assert moved > 1e-4, "the update did not change the parameters"

    assert [out[0]["generated"], out[1]["generated"]] == [2, 6]
    plain.eval()
    with torch.no_grad():
        want_logits = response_logits(plain, td, 1.0)
    want_lp, _ = compute_log_probs(plain, td, 1.0, 64)
    for rank in (0, 1):
        torch.testing.assert_close(out[rank]["logits"], want_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[rank]["log_probs"], want_lp, rtol=1e-4, atol=1e-5)
    for k, v in out[0]["full"].items():
        torch.testing.assert_close(out[0]["restored"][k], v, rtol=0, atol=0)


def test_the_checkpoint_file_loads_into_a_plain_hf_model(model_dir, fsdp_run):
    td, out, ckpt = fsdp_run
    from trainer.checkpoints.files import read_tensors

    plain = build_actor(model_dir)
    plain.load_state_dict(read_tensors(ckpt / "actor", prefix="model."), strict=True)
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(response_logits(plain, td, 1.0), out[0]["logits"])
    assert read_tensors(ckpt / "actor", prefix="optim.state."), "the optimizer state was not saved"
