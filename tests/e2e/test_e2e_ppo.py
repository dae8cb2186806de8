"""End-to-end PPO runs: the pytest form of the shell scripts RL repositories keep.

Each scenario is a real training run (``trainer.__main__.run_on_cluster``: the
same code as ``python -m trainer`` after ``ray.init``) on the module's one Ray
cluster, started by the ``e2e_ray`` fixture with the production runtime env.
Runs are module-scoped fixtures; the tests assert on what they produced:
rewards that rise, finite losses, KL terms that measure a real difference,
which processes hosted which role, checkpoint files and a resumed step count.

Every test runs on CPU (``[cpu]``, 2 gloo workers) and again on CUDA
(``[gpu1]``, ``[gpu2]``, NCCL), which skip before Ray starts when CUDA is not
there. The seeds are fixed, so a CPU run is reproducible; the learning margins
were chosen from the seeds measured in ``LEARNING_MARGIN``'s comment.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from trainer.__main__ import RunResult, run_on_cluster
from trainer.config import load_config
from trainer.models import ensure_tiny_model

pytestmark = pytest.mark.parametrize(
    "e2e_ray",
    [
        # Four CPUs: separate pools hold 2 actor + 2 critic processes.
        pytest.param({"num_cpus": 4}, id="cpu"),
        pytest.param({"num_cpus": 4, "num_gpus": 1}, marks=pytest.mark.gpu1, id="gpu1"),
        pytest.param({"num_cpus": 4, "num_gpus": 2}, marks=pytest.mark.gpu2, id="gpu2"),
    ],
    indirect=True,
)

# Steps of the learning runs, and how many steps at each end are averaged.
LEARN_STEPS = 15
ENDS = 3
# Mean reward of the last ENDS steps minus that of the first ENDS steps. A
# random-init policy starts near 0 (it rarely stops in time, and an unfinished
# response scores 0). Measured on the 2-core CPU machine with LEARN, seeds 0/1/2
# (first -> last): GAE colocated 0.004->0.264, 0.002->0.142, 0.005->0.149;
# GAE separate pools 0.005->0.296, 0.002->0.146, 0.005->0.138; GRPO with KL loss
# 0.004->0.264, 0.004->0.102, 0.007->0.298. With one worker (as in [gpu1]),
# GAE colocated: about 0.005->0.14, 0.007->0.11, 0.005->0.26. The smallest
# rise is 0.098; the margin is half of it, and 10x the starting level.
LEARNING_MARGIN = 0.05

# 64 prompts x 8 samples per step: small enough for seconds per step on two
# cores, large enough that the reward rises within LEARN_STEPS on every seed.
# The knobs that shape a short run are pinned to the values the margin was
# measured with, so retuning the defaults for long runs does not move it.
LEARN = [
    "critic.warmup_steps=0",
    "critic.ppo_epochs=1",
    "algorithm.lam=1.0",
    "actor.entropy_coeff=0.0",
    "actor.optim.lr=3e-3",
    "data.train_batch_size=64",
    "actor.ppo_mini_batch_size=32",
    "critic.ppo_mini_batch_size=32",
    "rollout.n=8",
    "data.num_val_examples=32",
    f"trainer.total_steps={LEARN_STEPS}",
    f"trainer.val_every={LEARN_STEPS}",
]
SAVE_AT_END = f"trainer.save_every={LEARN_STEPS}"
GAE_KL_IN_REWARD = ["algo=gae", "algorithm.use_kl_in_reward=true"]
GRPO = ["algo=grpo", "actor.use_kl_loss=true"]
SEED = 0
FINITE_ACTOR = ("actor/pg_loss", "actor/pg_clipfrac", "actor/approx_kl", "actor/grad_norm")
FINITE_CRITIC = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm")


# ----------------------------------------------------------------- helpers


def _device_overrides(num_gpus: int, pools: int = 1) -> list[str]:
    """Workers per pool for the cluster: 2 gloo ranks on CPU, one GPU each on CUDA."""
    if not num_gpus:
        return ["trainer.num_workers=2"]
    workers = num_gpus // pools
    if workers < 1:
        pytest.skip(f"{pools} separate pools need at least {pools} GPUs, {num_gpus} given")
    return ["trainer.use_gpu=true", f"trainer.num_workers={workers}"]


def _rewards(result: RunResult) -> list[float]:
    return [m["rollout/reward_mean"] for m in result.history]


def _assert_learns(result: RunResult) -> None:
    """The mean training reward of the last steps beats that of the first by the margin."""
    rewards = _rewards(result)
    assert len(rewards) == LEARN_STEPS, rewards
    first = sum(rewards[:ENDS]) / ENDS
    last = sum(rewards[-ENDS:]) / ENDS
    shown = " ".join(f"{r:.3f}" for r in rewards)
    assert last - first >= LEARNING_MARGIN, (
        f"reward did not rise by {LEARNING_MARGIN}: first {ENDS} steps {first:.3f}, "
        f"last {ENDS} {last:.3f}; per step: {shown}"
    )
    assert result.final_val_reward is not None and 0.0 <= result.final_val_reward <= 1.0


def _assert_finite(result: RunResult, keys: Sequence[str]) -> None:
    for step, metrics in enumerate(result.history, result.start_step + 1):
        for key in keys:
            assert key in metrics, f"step {step}: {key} missing; have {sorted(metrics)}"
            assert math.isfinite(metrics[key]), f"step {step}: {key}={metrics[key]}"


def _metric(result: RunResult, key: str) -> list[float]:
    return [m[key] for m in result.history]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model and tokenizer, built locally (nothing is downloaded)."""
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("model-cache")))


@pytest.fixture(scope="module")
def train(
    e2e_ray, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., RunResult]:
    """``train(name, *overrides, colocate=True, rollout_pool=False)``: one run on the module's cluster.

    ``rollout_pool``: generation on a rollout pool as large as the actor's.
    """

    def run(
        name: str,
        *overrides: str,
        colocate: bool = True,
        rollout_pool: bool = False,
        run_dir: Path | None = None,
    ):
        pools = 1 if colocate and not rollout_pool else 2
        devices = _device_overrides(e2e_ray.num_gpus, pools)
        if rollout_pool:
            workers = devices[-1].split("=")[1]
            devices.append(f"rollout.workers={workers}")
        cfg = load_config(
            [
                f"model.path={model_dir}",
                f"seed={SEED}",
                "trainer.progress=false",
                "trainer.tensorboard=false",
                f"trainer.run_dir={run_dir or tmp_path_factory.mktemp(name)}",
                *devices,
                *overrides,
            ]
        )
        return run_on_cluster(cfg, colocate=colocate)

    return run


@pytest.fixture(scope="module")
def gae_colocated(train) -> RunResult:
    """PPO with GAE and a critic colocated with the actor, KL penalty in the reward."""
    return train("gae-colocated", *GAE_KL_IN_REWARD, *LEARN, SAVE_AT_END)


@pytest.fixture(scope="module")
def gae_separate(train) -> RunResult:
    """PPO with GAE, the critic on a pool of its own."""
    return train("gae-separate", "algo=gae", *LEARN, colocate=False)


@pytest.fixture(scope="module")
def gae_actor_shares(train) -> RunResult:
    """PPO with GAE, the critic in processes of its own on the actor's bundles (short run)."""
    return train(
        "gae-actor-shares", "algo=gae", "trainer.colocate=actor", "trainer.total_steps=2",
        "trainer.val_every=0",
    )  # fmt: skip


@pytest.fixture(scope="module")
def gae_async(train) -> RunResult:
    """PPO with GAE, generation on a rollout pool one batch ahead of the update (short run)."""
    return train(
        "gae-async", "algo=gae", "rollout.staleness=1", "trainer.total_steps=3",
        "trainer.val_every=3", rollout_pool=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def grpo_kl_loss(train) -> RunResult:
    """GRPO (no critic) with the KL to the reference as a loss term."""
    return train("grpo", *GRPO, *LEARN, SAVE_AT_END)


# ----------------------------------------------------------------- learning


def test_ppo_with_gae_learns(gae_colocated: RunResult) -> None:
    _assert_learns(gae_colocated)
    _assert_finite(gae_colocated, FINITE_ACTOR + FINITE_CRITIC)
    rows = [json.loads(line) for line in gae_colocated.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, LEARN_STEPS + 1))
    assert gae_colocated.curve_path.stat().st_size > 0


def test_grpo_learns_without_a_critic(grpo_kl_loss: RunResult) -> None:
    _assert_learns(grpo_kl_loss)
    _assert_finite(grpo_kl_loss, FINITE_ACTOR)
    assert set(grpo_kl_loss.worker_pids) == {"actor"}
    assert not [k for k in grpo_kl_loss.history[0] if k.startswith("critic/")]


# ----------------------------------------------------------------- KL terms


def test_kl_in_reward_measures_the_policy_drifting_from_the_reference(
    gae_colocated: RunResult,
) -> None:
    kl = _metric(gae_colocated, "actor/reward_kl")
    coef = _metric(gae_colocated, "actor/kl_coef")
    assert all(math.isfinite(v) for v in kl + coef), kl
    assert all(c > 0 for c in coef), coef
    # Step 1 samples from the initial policy, which is the reference: KL 0 up to float
    # rounding (the frozen copy's shared-prompt pass can round its log-probs ~1e-7 apart).
    assert abs(kl[0]) < 1e-6, kl
    # After updates the policy's log-probs differ from the frozen reference's.
    assert min(abs(v) for v in kl[1:]) > 0.0, kl
    assert sum(kl[-ENDS:]) / ENDS > 1e-4, kl


def test_kl_loss_measures_the_policy_drifting_from_the_reference(
    grpo_kl_loss: RunResult,
) -> None:
    kl = _metric(grpo_kl_loss, "actor/kl_loss")
    assert all(math.isfinite(v) and v >= 0.0 for v in kl), kl  # k3 is never negative
    assert sum(kl[-ENDS:]) / ENDS > 1e-4, kl
    assert sum(kl[-ENDS:]) > sum(kl[:ENDS]), kl


# ----------------------------------------------------------------- placement


def test_colocated_roles_share_processes(gae_colocated: RunResult) -> None:
    pids = gae_colocated.worker_pids
    assert set(pids) == {"actor", "critic"}
    assert pids["actor"] == pids["critic"], pids
    assert len(set(pids["actor"])) == len(pids["actor"]), pids


def test_separate_pools_use_other_processes_and_learn(gae_separate: RunResult) -> None:
    pids = gae_separate.worker_pids
    assert set(pids) == {"actor", "critic"}
    assert not set(pids["actor"]) & set(pids["critic"]), pids
    _assert_learns(gae_separate)
    _assert_finite(gae_separate, FINITE_ACTOR + FINITE_CRITIC)


def test_async_generation_runs_on_its_own_pool_within_the_staleness_bound(
    gae_async: RunResult,
) -> None:
    pids = gae_async.worker_pids
    assert set(pids) == {"actor", "critic", "rollout"}
    assert not set(pids["actor"]) & set(pids["rollout"]), pids
    assert _metric(gae_async, "async/lag_max") == [0.0, 1.0, 1.0]
    assert _metric(gae_async, "async/queue_depth") == [1.0, 1.0, 0.0]
    pushes = [m["async/weights_in_sync"] for m in gae_async.history if "async/push_s" in m]
    assert pushes and set(pushes) == {1.0}, pushes
    _assert_finite(gae_async, FINITE_ACTOR + FINITE_CRITIC + ("rollout/is_ess",))
    assert gae_async.final_val_reward is not None


def test_actor_colocation_shares_bundles_from_separate_processes(
    gae_actor_shares: RunResult,
) -> None:
    pids = gae_actor_shares.worker_pids
    assert set(pids) == {"actor", "critic"}
    assert len(pids["actor"]) == len(pids["critic"]) >= 1, pids
    assert not set(pids["actor"]) & set(pids["critic"]), pids
    assert len(gae_actor_shares.history) == 2
    _assert_finite(gae_actor_shares, FINITE_ACTOR + FINITE_CRITIC)


# ----------------------------------------------------------------- checkpoints


def _checkpoint_files(result: RunResult, step: int) -> list[str]:
    directory = result.run_dir / "checkpoints" / f"step_{step:06d}"
    assert directory.is_dir(), f"no checkpoint {directory}"
    return sorted(p.name for p in directory.iterdir())


def test_checkpoint_holds_every_role_and_rank(gae_colocated: RunResult) -> None:
    files = _checkpoint_files(gae_colocated, LEARN_STEPS)
    ranks = len(gae_colocated.worker_pids["actor"])
    assert {"format.json", "driver.json", "actor", "critic"} <= set(files), files
    for role in ("actor", "critic"):
        directory = gae_colocated.run_dir / "checkpoints" / f"step_{LEARN_STEPS:06d}" / role
        expected = {".metadata", "state.json"}
        expected |= {f"__{r}_0.distcp" for r in range(ranks)} | {
            f"rank_{r}.json" for r in range(ranks)
        }
        assert expected <= {p.name for p in directory.iterdir()}, role


def test_resumed_run_continues_from_the_saved_step(grpo_kl_loss: RunResult, train) -> None:
    assert "format.json" in _checkpoint_files(grpo_kl_loss, LEARN_STEPS)
    resumed = train(
        "grpo",
        *GRPO,
        *LEARN,
        f"trainer.total_steps={LEARN_STEPS + 2}",
        "trainer.resume=auto",
        run_dir=grpo_kl_loss.run_dir,
    )
    assert resumed.start_step == LEARN_STEPS
    assert len(resumed.history) == 2
    _assert_finite(resumed, FINITE_ACTOR)
    rows = [json.loads(line) for line in resumed.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, LEARN_STEPS + 3))
    # The trained weights came back: a fresh policy would score like the first steps.
    before = sum(_rewards(grpo_kl_loss)[:ENDS]) / ENDS
    after = sum(_rewards(resumed)) / len(resumed.history)
    assert after - before >= LEARNING_MARGIN, (before, after, _rewards(resumed))
