"""Kill a real training process after a checkpoint, resume it, and get the same run.

Run A trains 2k steps without stopping. Run B is the same configuration,
SIGKILLed (driver and every process it started) once its step-k checkpoint
exists, then started again with ``trainer.resume=auto`` to finish. Both write
metrics.jsonl and a step-2k checkpoint: every metric at every step (all but
wall-clock timings and peak memory, which depend on the machine) must be equal, and the final weights equal within 1e-6.
The exported final model (``final_model/``) holds exactly the final checkpoint's policy.

B's final checkpoint resumed into a fresh run directory with no step left to
train finishes cleanly and says so (no nan reward, an empty metrics.jsonl).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from deadlines import hang_guard

from trainer.checkpoints.files import read_tensors
from trainer.models import ensure_tiny_model
from trainer.workers.setup import build_actor

K = 3
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def ray_tmp():
    # Ray's socket paths must stay short: a short private dir, removed after.
    d = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _args(model_dir: str, run_dir: Path, total: int, resume: str = "never") -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={total}",
        f"trainer.save_every={K}",
        f"trainer.resume={resume}",
        "trainer.val_every=2",
        "trainer.progress=false",
        "trainer.tensorboard=false",
        "algo=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl=adaptive",
        "algorithm.kl_horizon=100",
        "actor.entropy_coeff=0.01",
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=3",
        "critic.ppo_mini_batch_size=3",
        "rollout.n=2",
        "data.num_train_examples=20",
        "data.num_val_examples=4",
        "seed=7",
    ]


def _env(ray_tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_tmp
    env["PYTHONPATH"] = str(REPO)
    return env


def _run(args, env) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        args, env=env, cwd=REPO, capture_output=True, text=True, timeout=hang_guard(240)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every process it started (Ray's own, which leave its group)."""
    try:
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        family = [proc.pid]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=hang_guard(30))
    deadline = time.time() + 15
    while time.time() < deadline and any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in family
    ):
        time.sleep(0.1)


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {
            k: v
            for k, v in r.items()
            if not k.startswith(("timing/", "perf/peak_", "perf/max_memory"))
            and k != "perf/tokens_per_s"
        }
        for r in rows
    }


def _weights(run_dir: Path, role: str) -> dict[str, torch.Tensor]:
    return read_tensors(run_dir / "checkpoints" / f"step_{2 * K:06d}" / role, prefix="model.")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, ray_tmp) -> tuple[Path, Path]:
    """(A, B): A uninterrupted over 2k steps, B killed after its step-k checkpoint and resumed."""
    tmp_path = tmp_path_factory.mktemp("runs")
    env = _env(ray_tmp)
    a, b = tmp_path / "a", tmp_path / "b"
    # A runs alongside B's first part (its own Ray cluster) to save wall time.
    run_a = subprocess.Popen(
        _args(model_dir, a, 2 * K),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    # B: the same run, killed right after its step-K checkpoint.
    log = open(tmp_path / "b.log", "w")
    proc = subprocess.Popen(
        _args(model_dir, b, 100),
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    marker = b / "checkpoints" / f"step_{K:06d}" / "format.json"  # written last
    try:
        deadline = time.time() + 180
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "b.log").read_text()
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
    finally:
        _kill_tree(proc)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    out_a, _ = run_a.communicate(timeout=hang_guard(240))
    assert run_a.returncode == 0, out_a
    for later in (b / "checkpoints").glob("step_*"):
        if later.name != f"step_{K:06d}":  # a save that raced the kill: resume from K regardless
            shutil.rmtree(later)
    _run(_args(model_dir, b, 2 * K, resume="auto"), env)
    return a, b


def test_killed_and_resumed_run_equals_an_uninterrupted_one(runs):
    a, b = runs
    ma, mb = _metrics(a), _metrics(b)
    assert sorted(ma) == sorted(mb) == list(range(1, 2 * K + 1))
    for step in ma:
        assert ma[step] == mb[step], f"step {step} differs"
    assert "val/reward_mean" in ma[2] and "actor/kl_coef" in ma[1]
    for role in ("actor", "critic"):
        wa, wb = _weights(a, role), _weights(b, role)
        for name in wa:
            torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6)
    # The end-of-run export (trainer.export_final) is the final policy, loadable by from_pretrained.
    exported = build_actor(str(b / "final_model")).state_dict()
    wb = _weights(b, "actor")
    assert set(exported) == set(wb)
    for name, value in wb.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)


def test_a_checkpoint_with_no_step_left_resumed_into_a_new_run_dir_finishes(
    runs, model_dir, ray_tmp, tmp_path
):
    _, b = runs
    final = b / "checkpoints" / f"step_{2 * K:06d}"
    fresh = tmp_path / "fresh"
    out = _run(_args(model_dir, fresh, 2 * K, resume=str(final)), _env(ray_tmp)).stdout
    assert f"trainer: resumed from {final} at step {2 * K}" in out
    assert (
        "trainer: done: no training step ran in " in out
        and f"(nothing left to train: at step {2 * K} of trainer.total_steps={2 * K})" in out
    ), out
    assert "reward nan" not in out and "val/reward_mean" not in out, out
    assert (fresh / "metrics.jsonl").read_text() == ""
    assert (fresh / "reward_curve.png").is_file() and (fresh / "final_model").is_dir()
