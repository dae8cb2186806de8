"""Global loss aggregation on real gloo ranks: the split of a batch does not matter.

A tiny token policy is updated with ``policy_loss`` in two ways:

- reference: one process, the whole batch in one piece, no ``norm``;
- split: 2 data-parallel ranks (spawned, gloo), each with its half of the
  batch cut into micro-batches of different sizes, gradients summed over
  micro-batches and averaged over ranks (as DDP/FSDP do), ``agg_norm`` over
  each rank's half.

Valid-token and sequence counts differ between ranks and micro-batches (one
sequence is fully masked), which is where per-micro-batch means go wrong: the
same split with naive local means is run as a control and must differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from deadlines import hang_guard

from rl_e2e.distributed import run_distributed
from trainer.algorithms.ppo_math import AGG_MODES, agg_norm, policy_loss

VOCAB, DIM, BATCH, LENGTH = 11, 8, 8, 6
LR, STEPS = 0.5, 2
# Valid tokens per row: rank 0 gets rows 0-3 (6+1+3+0 = 10), rank 1 rows 4-7 (5+2+6+4 = 17).
LENGTHS = [6, 1, 3, 0, 5, 2, 6, 4]
# Micro-batch sizes (rows) per rank: token counts 7, 3 on rank 0 and 5, 12 on rank 1.
MICRO_SPLITS = {0: [2, 2], 1: [1, 3]}
RTOL = 1e-5


class TinyPolicy(torch.nn.Module):
    """Next-token logits from the current token: an embedding and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def log_probs(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(inputs)))
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def make_batch() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The initial weights and a batch whose old log-probs make clipping and dual-clipping happen."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyPolicy()
    inputs = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    mask = torch.arange(LENGTH)[None, :] < torch.tensor(LENGTHS)[:, None]
    with torch.no_grad():
        current = model.log_probs(inputs, targets)
    shift = 0.4 * torch.randn(BATCH, LENGTH, generator=gen)
    shift[::3, ::2] -= 1.5  # ratio e^1.5 > 3 on some tokens: dual-clip for negative advantages
    batch = {
        "inputs": inputs,
        "targets": targets,
        "mask": mask,
        "old_log_prob": current + shift,
        "advantages": torch.randn(BATCH, LENGTH, generator=gen),
    }
    return {k: v.clone() for k, v in model.state_dict().items()}, batch


def train(
    state: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    mode: str,
    micro_sizes: list[int],
    global_norm: bool,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """STEPS SGD steps on ``batch`` (this rank's part); returns weights and clip fractions.

    ``global_norm``: aggregate with :func:`agg_norm` (the method under test);
    otherwise each micro-batch takes its local mean, scaled by 1/#micro-batches
    (plain gradient accumulation: the naive control).
    """
    model = TinyPolicy()
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    clipfracs = []
    for _ in range(STEPS):
        opt.zero_grad()
        norm = agg_norm(batch["mask"], mode) if global_norm else None
        rows = 0
        for size in micro_sizes:
            micro = {k: v[rows : rows + size] for k, v in batch.items()}
            rows += size
            log_prob = model.log_probs(micro["inputs"], micro["targets"])
            loss, metrics = policy_loss(
                micro["old_log_prob"],
                log_prob,
                micro["advantages"],
                micro["mask"],
                agg=mode,
                norm=norm,
            )
            if not global_norm:
                loss = loss / len(micro_sizes)
            loss.backward()
            clipfracs += [metrics["pg_clipfrac"], metrics["pg_clipfrac_lower"]]
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, clipfracs


def _rank_fn(rank: int, world_size: int, state: dict, batch: dict) -> dict:
    """On each rank: both kinds of split update for every mode, plus an agg_norm probe."""
    rows = BATCH // world_size
    mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    out = {"norm_probe": agg_norm(torch.ones(1, 3 + rank), "token-mean")}
    for mode in AGG_MODES:
        out[mode] = {
            "global": train(state, mine, mode, MICRO_SPLITS[rank], True)[0],
            "naive": train(state, mine, mode, MICRO_SPLITS[rank], False)[0],
        }
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    """Reference updates in this process, split updates on 2 gloo ranks (one spawn)."""
    state, batch = make_batch()
    reference = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: worker threads only add wake-up latency
    try:
        for mode in AGG_MODES:
            weights, clipfracs = train(state, batch, mode, [BATCH], global_norm=True)
            reference[mode] = weights
            reference[f"{mode}/clipfracs"] = clipfracs
    finally:
        torch.set_num_threads(threads)
    per_rank = run_distributed(_rank_fn, 2, state, batch, backend="gloo", timeout_s=hang_guard(120))
    return reference, per_rank


def test_agg_norm_all_reduces_counts_and_takes_the_largest_padded_length(runs) -> None:
    _, per_rank = runs
    for out in per_rank:
        norm = out["norm_probe"]  # rank 0: 3 tokens in 1 row of 3; rank 1: 4 in 1 row of 4
        assert (norm.tokens, norm.seqs, norm.padded_len, norm.world_size) == (7.0, 2.0, 4, 2)


def test_the_batch_exercises_clipping_and_dual_clipping(runs) -> None:
    reference, _ = runs
    clipfrac, lower = reference["token-mean/clipfracs"][:2]
    assert 0 < lower <= clipfrac < 1  # both clips active on some tokens, not on all


@pytest.mark.parametrize("mode", AGG_MODES)
def test_two_ranks_with_micro_batches_match_one_process(runs, mode: str) -> None:
    reference, per_rank = runs
    for rank, out in enumerate(per_rank):
        for name, expected in reference[mode].items():
            actual = out[mode]["global"][name]
            assert not torch.equal(expected, make_batch()[0][name])  # the step moved it
            torch.testing.assert_close(
                actual,
                expected,
                rtol=RTOL,
                atol=1e-7,
                msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}",
            )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_naive_per_micro_batch_means_do_not_match(runs, mode: str) -> None:
    """The control: the same split without agg_norm gives different weights."""
    reference, per_rank = runs
    naive = per_rank[0][mode]["naive"]
    diffs = [
        ((naive[n] - w).abs().max() / w.abs().max()).item() for n, w in reference[mode].items()
    ]
    assert max(diffs) > 100 * RTOL


def _nccl_norm(rank: int, world_size: int) -> tuple:
    """agg_norm over NCCL with a CPU mask (moved to the GPU for the collective)."""
    norm = agg_norm(torch.ones(2, 3 + rank, dtype=torch.bool), "seq-mean-token-sum-norm")
    return norm.tokens, norm.seqs, norm.padded_len, norm.world_size


@pytest.mark.gpu2
def test_agg_norm_over_nccl_with_cpu_masks() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    out = run_distributed(_nccl_norm, 2, backend="nccl", timeout_s=120)
    assert out == [(14.0, 4.0, 4, 2)] * 2  # rows of 3 and 4 tokens, 2 per rank
