"""Rank functions for the vLLM engine tests, run by ``run_distributed`` in spawned processes.

Module-level (picklable) and importable without vLLM; each builds the actor and
its engine the way :class:`~trainer.workers.actor.ActorRolloutRefWorker` does.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

KV_CACHE = 64 * 2**20


def prompts(tok: Any, n_prompts: int, n: int):
    """The synthetic task's first ``n_prompts`` prompts, each repeated ``n`` times."""
    from trainer.config import load_config
    from trainer.data import batch as batch_ops
    from trainer.data.prompts import build_datasets

    cfg = load_config([f"data.num_train_examples={max(n_prompts, 4)}", "data.num_val_examples=4"])
    train, _ = build_datasets(cfg, tok)
    td, _, _ = train.batch(range(n_prompts))
    return batch_ops.repeat_interleave(td, n)


def build(model_dir: str, device: torch.device, strategy: str = "fsdp2", seed: int = 0):
    """Tokenizer, actor (FSDP2 over the world, or whole) and a vLLM engine on ``device``."""
    from trainer.models import load_tokenizer
    from trainer.rollout import build_engine
    from trainer.workers.actor import place_model
    from trainer.workers.setup import build_actor

    tok = load_tokenizer(model_dir)
    actor = place_model(build_actor(model_dir), device, strategy)
    engine = build_engine(
        "vllm", actor, tok, model_path=model_dir, device=device, kv_cache_memory=KV_CACHE, seed=seed
    )
    return tok, actor, engine


def actor_log_probs(actor: torch.nn.Module, batch, device: torch.device) -> torch.Tensor:
    """The actor's log-prob of each response token (temperature 1), on the CPU."""
    from trainer import fsdp
    from trainer.workers.compute import compute_log_probs

    ctx = fsdp.gathered_for_inference(actor) if fsdp.is_sharded(actor) else nullcontext()
    with ctx:
        lp, _ = compute_log_probs(actor, batch.to(device), 1.0, 64)
    return lp.cpu()


def mean_prob_gap(actor, batch, device) -> float:
    """Mean |p_actor - p_vllm| over the sampled tokens of ``batch``."""
    m = batch["response_mask"].bool()
    alp = actor_log_probs(actor, batch, device)
    return float((alp[m].exp() - batch["rollout_log_probs"][m].exp()).abs().mean())


def greedy_against_hf(rank: int, world: int, model_dir: str, device_type: str) -> dict:
    """Greedy tokens of vLLM and of HF ``generate`` on the same weights, before and after a push."""
    from trainer.rollout import SamplingParams, build_engine

    device = torch.device(device_type)
    tok, actor, engine = build(model_dir, device, strategy="ddp")
    hf = build_engine("hf", actor, tok)
    td = prompts(tok, 4, 2)  # a prompt twice in a row: greedy asks vLLM once per row
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    before_vllm = engine.generate(td, greedy)
    before_hf = hf.generate(td.to(device), greedy).to("cpu")
    with torch.no_grad():  # move the actor far from the weights vLLM loaded from disk
        torch.manual_seed(1)
        for p in actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    stale = engine.generate(td, greedy)
    engine.sync_weights()
    after_vllm = engine.generate(td, greedy)
    after_hf = hf.generate(td.to(device), greedy).to("cpu")
    engine.close()
    return {
        "before": (before_vllm["responses"], before_hf["responses"]),
        "stale": stale["responses"],
        "after": (after_vllm["responses"], after_hf["responses"]),
        "mask": after_vllm["response_mask"],
        "log_probs": after_vllm["rollout_log_probs"],
        "dynamo": dict(torch._dynamo.utils.counters["stats"]),
    }


def two_ranks_sync(rank: int, world: int, model_dir: str, device_type: str) -> dict:
    """FSDP2 over the ranks, one engine each: gaps before and after a sync, then a collective."""
    from trainer.rollout import SamplingParams

    device = torch.device(device_type)
    tok, actor, engine = build(model_dir, device, seed=rank)
    td = prompts(tok, 4, 4)
    sample = SamplingParams(max_new_tokens=8, temperature=1.0)
    fresh = mean_prob_gap(actor, engine.generate(td, sample), device)
    with torch.no_grad():
        torch.manual_seed(7)  # the same step on every rank: the shards stay one model
        for p in actor.parameters():
            p.add_(0.2 * torch.randn_like(p))
    stale = mean_prob_gap(actor, engine.generate(td, sample), device)
    engine.sync_weights()
    out = engine.generate(td, sample)
    synced = mean_prob_gap(actor, out, device)
    engine.close()
    # The ranks' world outlives the engines: a collective after the teardown works.
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    dist.barrier()
    return {
        "fresh": fresh,
        "stale": stale,
        "synced": synced,
        "sum": float(t),
        "responses": out["responses"],
        "world": dist.get_world_size(),
    }


def steps_per_fault(rank: int, world: int, model_dir: str, faults: list[str | None]) -> dict:
    """A few update-and-push steps per fault (None: the real sync), each on a fresh engine.

    The loop of a worker's step: sample with the engine, one on-policy
    ``update_policy`` pass (which measures the engine/actor mismatch on its
    own forward, before it steps), push the weights. Returns the per-step
    mismatch metrics per fault.
    """
    import vllm_faults

    from trainer.algorithms.mismatch import mismatch_metrics, pop_totals
    from trainer.rollout import SamplingParams
    from trainer.workers.compute import PolicyUpdateSettings, update_policy

    device = torch.device("cpu")
    out: dict = {}
    for fault in faults:
        undo = getattr(vllm_faults, fault)() if fault else (lambda: None)
        try:
            tok, actor, engine = build(model_dir, device)
            opt = torch.optim.Adam(actor.parameters(), lr=1e-2)
            td = prompts(tok, 8, 4)
            gen = torch.Generator().manual_seed(0)
            rows = []
            for _ in range(3):
                batch = engine.generate(td, SamplingParams(max_new_tokens=8, temperature=1.0))
                noise = torch.randn(batch["response_mask"].shape, generator=gen)
                batch["advantages"] = noise * batch["response_mask"]
                metrics = update_policy(actor, opt, batch, PolicyUpdateSettings(grad_clip=1.0))
                rows.append(mismatch_metrics(pop_totals(metrics)))
                engine.sync_weights()
            engine.close()
        finally:
            undo()
        out[fault] = rows
    return out
