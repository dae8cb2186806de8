"""Device, backend and strategy selection: pure decisions, no GPU needed."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.workers.device import backend_for, resolve_device, worker_device
from trainer.workers.fsdp import decoder_layers, mixed_precision_policy, resolve_strategy


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
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization=0.0"):
        load_config(["rollout.gpu_memory_utilization=0"])


def test_auto_asks_ray_for_gpu_bundles_only_when_the_driver_sees_cuda():
    from trainer.workers.device import wants_gpu_bundles

    assert wants_gpu_bundles("auto", driver_sees_cuda=True)
    assert not wants_gpu_bundles("auto", driver_sees_cuda=False)
    assert wants_gpu_bundles("cuda", driver_sees_cuda=False)  # GPUs may live on other nodes
    assert not wants_gpu_bundles("cpu", driver_sees_cuda=True)
    with pytest.raises(ValueError, match="trainer.device='tpu'"):
        wants_gpu_bundles("tpu", driver_sees_cuda=True)
