"""Device, backend and strategy selection: pure decisions, no GPU needed."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.fsdp import decoder_layers, mixed_precision_policy, resolve_strategy
from trainer.workers.device import backend_for, resolve_device, worker_device


@pytest.mark.parametrize(
    ("requested", "cuda", "want"),
    [
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("cuda", True, "cuda"),
        ("cpu", True, "cpu"),
        ("cpu", False, "cpu"),
    ],
)
def test_resolve_device(requested, cuda, want):
    assert resolve_device(requested, cuda) == want


def test_cuda_without_a_card_says_why():
    with pytest.raises(RuntimeError, match=r"trainer.device=cuda: .*CUDA_VISIBLE_DEVICES=''"):
        resolve_device("cuda", False, visible_devices="")
    with pytest.raises(RuntimeError, match=r"trainer.device=cuda: .*torch.cuda.is_available"):
        resolve_device("cuda", False, visible_devices=None)
    with pytest.raises(ValueError, match=r"trainer.device='gpu'"):
        resolve_device("gpu", True)


def test_the_worker_device_here_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU fallback; CUDA is available here")
    assert worker_device("auto") == torch.device("cpu")
    assert worker_device("cpu") == torch.device("cpu")


def test_backend_follows_the_device():
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="'mps'"):
        backend_for("mps")


@pytest.mark.parametrize(
    ("strategy", "device", "want"),
    [
        ("auto", "cuda", "fsdp2"),
        ("auto", "cpu", "ddp"),
        ("fsdp2", "cpu", "fsdp2"),
        ("ddp", "cuda", "ddp"),
    ],
)
def test_resolve_strategy(strategy, device, want):
    assert resolve_strategy(strategy, device) == want


def test_a_bad_strategy_names_its_key():
    with pytest.raises(ValueError, match=r"critic.strategy='zero3'"):
        resolve_strategy("zero3", "cuda", "critic.strategy")


def test_mixed_precision_is_bf16_compute_fp32_reduce_on_cuda_only():
    policy = mixed_precision_policy("cuda")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("cpu") is None


def test_decoder_layers_come_from_no_split_modules():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    layers = decoder_layers(LlamaForCausalLM(cfg))
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 3
    with pytest.raises(ValueError, match=r"Linear: no decoder layers found"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_config_device_and_strategy_keys():
    cfg = load_config(["trainer.device=cuda", "actor.strategy=fsdp2", "critic.offload=true"])
    assert cfg.trainer.use_gpu and cfg.device_request == "cuda"
    assert load_config([]).device_request == "auto"
    assert load_config(["trainer.use_gpu=true"]).device_request == "cuda"
    with pytest.raises(ConfigError, match=r"trainer.device='tpu'"):
        load_config(["trainer.device=tpu"])
    with pytest.raises(ConfigError, match=r"actor.strategy='zero'"):
        load_config(["actor.strategy=zero"])
    with pytest.raises(ConfigError, match=r"critic.offload=true with critic.strategy=ddp"):
        load_config(["critic.offload=true", "critic.strategy=ddp"])
    with pytest.raises(ConfigError, match=r"trainer.use_gpu=true and trainer.device=cpu"):
        load_config(["trainer.use_gpu=true", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_memory='0': .* must be positive"):
        load_config(["rollout.kv_cache_memory=0"])
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_memory='lots': .* not a size"):
        load_config(["rollout.kv_cache_memory=lots"])
    with pytest.raises(ConfigError, match=r"rollout.tis_cap=2.0 .* set rollout.engine=vllm"):
        load_config(["rollout.tis_cap=2"])


@pytest.mark.parametrize(
    ("requested", "cluster_gpus", "workers", "pools", "want"),
    [
        ("auto", 0, 0, 1, ("cpu", 2)),  # a CPU cluster, whatever the driver's CUDA shows
        ("auto", 0, 3, 1, ("cpu", 3)),
        ("auto", 1, 0, 1, ("cuda", 1)),  # python -m trainer on a 1-GPU node
        ("auto", 8, 0, 1, ("cuda", 8)),  # ... and on an 8-GPU node
        ("auto", 8, 0, 2, ("cuda", 4)),  # a critic pool of its own takes half
        ("auto", 8, 2, 1, ("cuda", 2)),
        ("cuda", 4, 0, 1, ("cuda", 4)),
        ("cpu", 8, 0, 1, ("cpu", 2)),
        ("cpu", 8, 5, 2, ("cpu", 5)),
    ],
)
def test_the_cluster_decides_device_and_worker_count(requested, cluster_gpus, workers, pools, want):
    from trainer.workers.device import plan_devices

    plan = plan_devices(requested, cluster_gpus, workers, pools)
    assert (plan.device, plan.num_workers) == want
    assert plan.use_gpu == (want[0] == "cuda")


def test_asking_for_more_gpu_workers_than_the_cluster_has_is_a_clear_error():
    from trainer.workers.device import plan_devices

    with pytest.raises(RuntimeError, match=r"trainer.num_workers=2: .* offers 1 GPU"):
        plan_devices("auto", 1, 2)
    with pytest.raises(RuntimeError, match=r"trainer.num_workers=3: .*2 pools"):
        plan_devices("cuda", 4, 3, pools=2)
    with pytest.raises(RuntimeError, match=r"trainer.device=cuda: the Ray cluster offers no GPU"):
        plan_devices("cuda", 0, 0)
    with pytest.raises(RuntimeError, match=r"2 pools need at least 2 GPUs"):
        plan_devices("auto", 1, 0, pools=2)
    with pytest.raises(ValueError, match=r"trainer.device='tpu'"):
        plan_devices("tpu", 1, 0)


@pytest.mark.parametrize(
    ("requested", "cuda", "granted", "want"),
    [
        ("auto", True, [], "cpu"),  # CUDA visible, but Ray granted no GPU: CPU and gloo
        ("auto", False, [], "cpu"),
        ("auto", True, ["0"], "cuda"),
        ("cuda", True, ["3"], "cuda"),
        ("cpu", True, ["0"], "cpu"),
    ],
)
def test_in_a_ray_worker_the_grant_decides(requested, cuda, granted, want):
    assert resolve_device(requested, cuda, None, granted) == want


def test_grant_and_cuda_disagreeing_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"trainer.device=cuda: Ray granted this worker no GPU"):
        resolve_device("cuda", True, None, [])
    with pytest.raises(RuntimeError, match=r"granted this worker GPU\(s\) \['1'\] but torch sees"):
        resolve_device("auto", False, "1", ["1"])


def test_peak_memory_is_reported_per_device():
    from trainer.workers.memory import peak_memory_metrics

    blob = torch.ones(64, 2**20, dtype=torch.uint8)  # 64 MiB touched: the peak is at least this
    cpu = peak_memory_metrics(torch.device("cpu"))
    assert set(cpu) == {"perf/peak_rss_gb"} and cpu["perf/peak_rss_gb"] >= 64 / 1024
    del blob
