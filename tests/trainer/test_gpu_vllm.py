"""vLLM rollout on a GPU: weight sync, sleep/wake memory, and end-to-end PPO runs.

The same engine code as the CPU tests (``test_vllm_engine.py``), on CUDA: the
engine computes in bf16 there (the FSDP2 actor's compute dtype) and sleeps
between generations. Every test skips cleanly without CUDA or without the
``vllm`` package, with a reason that says which.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from rl_e2e.distributed import run_distributed
from trainer.models import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
import vllm_ranks  # noqa: E402  (rank functions must be importable by spawned ranks)


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")


def _need_vllm() -> None:
    _need_cuda()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm: the package is not installed (pip install -e '.[vllm]')")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _rank_sleep_frees_memory(rank: int, world: int, model_dir: str) -> dict:
    from trainer.rollout import SamplingParams

    device = torch.device("cuda", torch.cuda.current_device())
    tok, actor, engine = vllm_ranks.build(model_dir, device)
    engine.llm.wake_up()
    free_awake, total = torch.cuda.mem_get_info()
    engine.llm.sleep(level=1)
    free_asleep, _ = torch.cuda.mem_get_info()
    out = engine.generate(vllm_ranks.prompts(tok, 4, 2), SamplingParams(8))
    engine.close()
    return {"freed": free_asleep - free_awake, "total": total, "rows": out.batch_size[0]}


@pytest.mark.gpu1
def test_weight_sync_makes_vllm_and_actor_log_probs_agree(model_dir):
    _need_vllm()
    [out] = run_distributed(
        vllm_ranks.two_ranks_sync, 1, model_dir, "cuda", backend="nccl", timeout_s=600
    )
    # bf16 vLLM vs bf16 FSDP2 compute: a small mean |p difference| once synced.
    assert out["synced"] < 0.01, out
    assert out["stale"] > 4 * out["synced"], out
    assert out["sum"] == 1.0


@pytest.mark.gpu1
def test_sleep_frees_the_kv_cache_and_generation_wakes_it(model_dir):
    _need_vllm()
    [out] = run_distributed(_rank_sleep_frees_memory, 1, model_dir, backend="nccl", timeout_s=600)
    # The KV cache is vllm_ranks.KV_CACHE bytes; sleeping frees at least most of it.
    assert out["freed"] > 0.5 * vllm_ranks.KV_CACHE, out
    assert out["rows"] == 8


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
        trainer_cli, tmp_path, "rollout.engine=vllm", "rollout.kv_cache_memory=1GiB"
    )
    assert len(rows) == 4
    assert all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in rows)
    assert all(r["rollout/actor_prob_diff_mean"] < 0.01 for r in rows)
    assert "val/reward_mean" in rows[-1]
