"""FSDP2 on CUDA with NCCL: bf16 mixed precision, 1 vs 2 ranks, CPU offload.

Skip cleanly without CUDA (or with too few cards), each with a reason saying
which. The same wrapping runs on CPU/gloo in ``test_fsdp.py``; what only a GPU
can show is bf16 compute with fp32 master weights, NCCL reduce-scatter, and
the offload policy.
"""

from __future__ import annotations

import pytest
import torch
from test_fsdp import ROWS, SETTINGS, _batch  # same batch as the CPU test (rootdir-relative import)

from rl_e2e.distributed import run_distributed
from trainer import fsdp
from trainer.models import ensure_tiny_model
from trainer.workers.compute import response_logits, update_policy
from trainer.workers.setup import build_actor


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _rank_update(rank: int, world: int, model_dir: str, td, offload: bool) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    model = fsdp.shard_model(build_actor(model_dir), device, cpu_offload=offload)
    dtypes = {p.dtype for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard = td.split(ROWS // world)[rank].to(device)
    torch.cuda.reset_peak_memory_stats()
    metrics = update_policy(model, opt, shard, SETTINGS)
    with fsdp.gathered_for_inference(model), torch.no_grad():
        compute_dtype = next(model.parameters()).dtype
        logits = response_logits(model, shard, 1.0)
    local_devices = {p.to_local().device.type for p in model.parameters()}
    return {
        "full": fsdp.full_state_dict(model),
        "metrics": metrics,
        "param_dtypes": dtypes,
        "compute_dtype": compute_dtype,
        "logits_finite": bool(torch.isfinite(logits).all()),
        "local_devices": local_devices,
    }


@pytest.mark.gpu2
def test_fsdp2_bf16_two_nccl_ranks_match_one(model_dir):
    _need_gpus(2)
    td = _batch(model_dir)
    one = run_distributed(_rank_update, 1, model_dir, td, False, backend="nccl", timeout_s=300)
    two = run_distributed(_rank_update, 2, model_dir, td, False, backend="nccl", timeout_s=300)
    # bf16 compute: the two runs differ only by reduction order and rounding.
    for k, v in one[0]["full"].items():
        torch.testing.assert_close(two[0]["full"][k], v, rtol=2e-2, atol=2e-3)
    assert one[0]["param_dtypes"] == {torch.float32}  # fp32 master weights
    assert one[0]["compute_dtype"] == torch.bfloat16  # bf16 gathered copy for compute
    assert one[0]["logits_finite"] and two[1]["logits_finite"]


@pytest.mark.gpu1
def test_fsdp2_cpu_offload_keeps_shards_in_host_memory(model_dir):
    _need_gpus(1)
    td = _batch(model_dir)
    [out] = run_distributed(_rank_update, 1, model_dir, td, True, backend="nccl", timeout_s=300)
    assert out["local_devices"] == {"cpu"}
    assert all(torch.isfinite(torch.tensor(v)) for v in out["metrics"].values())
    plain = build_actor(model_dir)
    plain.load_state_dict(out["full"])  # the offloaded model still saves to plain HF names
