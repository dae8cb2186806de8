"""vLLM rollout on a GPU: weight sync, sleep/wake memory, and end-to-end PPO runs.

Every test skips cleanly without CUDA or without the ``vllm`` package, with a
reason that says which. The engine runs colocated with an FSDP2 actor in one
NCCL rank (spawned), as in the trainer's workers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from trainer.distributed import run_distributed
from trainer.models import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")


def _need_vllm() -> None:
    _need_cuda()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm: the package is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _prompts(tok, n_prompts: int, n: int):
    from trainer import batch as batch_ops
    from trainer.config import load_config
    from trainer.data import build_datasets

    cfg = load_config([f"data.num_train_examples={n_prompts}", "data.num_val_examples=4"])
    train, _ = build_datasets(cfg, tok)
    prompts, _, _ = train.batch(range(n_prompts))
    return batch_ops.repeat_interleave(prompts, n)


def _vllm_log_probs(engine, td, max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample with vLLM directly, asking for the sampled tokens' log-probs."""
    from vllm import SamplingParams as VSP

    from trainer.rollout import finish_responses
    from trainer.rollout.vllm import _pad_rows, _unpadded_prompts

    ids, mask = td["input_ids"].cpu(), td["attention_mask"].cpu()
    reqs = [{"prompt_token_ids": p} for p in _unpadded_prompts(ids, mask)]
    if not engine.weights_awake:
        engine._wake(["weights"])
    engine._wake(["kv_cache"])
    try:
        outs = engine.llm.generate(
            reqs,
            VSP(
                max_tokens=max_new,
                temperature=1.0,
                logprobs=0,
                stop_token_ids=[engine.eos_token_id],
            ),
            use_tqdm=False,
        )
    finally:
        engine.llm.sleep(level=1)
        engine.weights_awake = False
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    batch = finish_responses(ids, mask, _pad_rows(toks, 0), max_new, engine.eos_token_id, 0)
    lp = torch.zeros(batch["responses"].shape)
    for i, row in enumerate(lps):
        lp[i, : min(len(row), max_new)] = torch.tensor(row[:max_new])
    return batch, lp


def _rank_weight_sync(rank: int, world: int, model_dir: str) -> dict:
    from trainer.models import load_tokenizer
    from trainer.rollout.vllm import VLLMEngine
    from trainer.workers import fsdp
    from trainer.workers.compute import compute_log_probs
    from trainer.workers.setup import build_actor

    device = torch.device("cuda", torch.cuda.current_device())
    tok = load_tokenizer(model_dir)
    actor = fsdp.shard_model(build_actor(model_dir), device)
    engine = VLLMEngine(actor, tok, model_path=model_dir, gpu_memory_utilization=0.3)
    td = _prompts(tok, 16, 2)
    # Move the actor far from the weights vLLM loaded from disk.
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def gap() -> float:
        batch, vlp = _vllm_log_probs(engine, td, 8)
        with fsdp.gathered_for_inference(actor):
            alp, _ = compute_log_probs(actor, batch.to(device), 1.0, 64)
        m = batch["response_mask"].bool()
        return float((alp.cpu()[m] - vlp[m]).abs().mean())

    stale = gap()
    engine.sync_weights()
    synced = gap()
    engine._wake(["weights"])
    engine._wake(["kv_cache"])
    free_awake, total = torch.cuda.mem_get_info()
    engine.llm.sleep(level=1)
    engine.weights_awake = False
    free_asleep, _ = torch.cuda.mem_get_info()
    return {
        "stale": stale,
        "synced": synced,
        "freed": free_asleep - free_awake,
        "total": total,
    }


@pytest.mark.gpu1
def test_weight_sync_makes_vllm_and_actor_log_probs_agree_and_sleep_frees_memory(model_dir):
    _need_vllm()
    [out] = run_distributed(_rank_weight_sync, 1, model_dir, backend="nccl", timeout_s=600)
    # bf16 vLLM vs bf16 FSDP2 compute: small mean |difference| once synced.
    assert out["synced"] < 0.05, out
    assert out["stale"] > 4 * out["synced"], out
    # Sleep releases the KV cache (about 0.3 of the card minus the tiny weights).
    assert out["freed"] > 0.15 * out["total"], out


def _run_trainer(trainer_cli, tmp_path: Path, *args: str) -> list[dict]:
    run_dir = tmp_path / "run"
    proc = trainer_cli(
        "trainer.device=cuda",
        "trainer.num_workers=1",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=4",
        "trainer.val_every=2",
        "trainer.tensorboard=false",
        *args,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu1
def test_ppo_on_cuda_with_fsdp2_and_the_hf_engine(trainer_cli, tmp_path):
    _need_cuda()
    rows = _run_trainer(trainer_cli, tmp_path, "rollout.engine=hf")
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in rows)


@pytest.mark.gpu1
def test_ppo_on_cuda_with_fsdp2_and_vllm_rollout(trainer_cli, tmp_path):
    _need_vllm()
    rows = _run_trainer(
        trainer_cli, tmp_path, "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3"
    )
    assert len(rows) == 4
    assert all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in rows)
    assert "val/reward_mean" in rows[-1]
