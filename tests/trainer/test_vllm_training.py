"""``python -m trainer rollout.engine=vllm`` on CPU: the weights stay in sync, a broken sync is caught.

The check is the engine/actor log-prob mismatch the trainer reports every
step (:mod:`trainer.algorithms.mismatch`): ``vllm_faults.assert_in_sync``. A run
with the real sync must pass it for 10 steps (mean absolute difference of token
probabilities below 1e-3, float32 on both sides); a run whose workers skip the
push after step 1 (installed by ``TRAINER_EXTRA_WORKER_SETUP_HOOK``) must fail
it (that run then has a worker killed: one start for both tests). No process
of a run outlives it, also when a worker is killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deadlines import hang_guard, wait_until
from test_vllm_engine import _cpu_vllm  # noqa: E402  (same skip rule)
from trainer_processes import (
    TAG,
    assert_all_gone,
    output_of_ended,
    tagged,
    trainer_process,
    wait_for_first_step,
)
from vllm_faults import assert_in_sync

pytestmark = pytest.mark.skipif(_cpu_vllm() is not None, reason=str(_cpu_vllm()))

FAULTS = Path(__file__).with_name("vllm_faults.py")

# Small and quick: 2 workers, 8 prompts x 4 samples, one on-policy pass per step
# (the mismatch is then measured on the update's own forward).
RUN = (
    "rollout.engine=vllm",
    "rollout.kv_cache_memory=32MiB",
    "algo=grpo",
    "rollout.n=4",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "trainer.val_every=0",
    "trainer.tensorboard=false",
)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_real_sync_keeps_engine_and_actor_within_1e_3_for_10_steps(trainer_cli, tmp_path):
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = trainer_cli(
        *RUN,
        "trainer.total_steps=10",
        f"trainer.run_dir={run_dir}",
        env={TAG: tag},
        timeout=hang_guard(400),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert_in_sync(rows)
    assert all(r["rollout/actor_prob_diff_gt_0.1"] == 0 for r in rows)
    # The step changed the policy (so a missed push would have shown).
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert_all_gone(tag, [])


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """``(driver, tag, run_dir)``: a run whose workers skip the push after step 1, still running.

    One ``python -m trainer`` start serves two tests: the first reads its first
    4 steps, the second then kills one of its workers. (The fault only patches
    ``VLLMEngine.sync_weights`` in the workers; how a dead worker ends the run
    does not go through it.) It is killed at the end of the module if still running.
    """
    tmp_path = tmp_path_factory.mktemp("broken")
    run_dir = tmp_path / "run"
    args = (*RUN, "trainer.total_steps=200", f"trainer.run_dir={run_dir}")
    with pytest.MonkeyPatch.context() as mp:
        # trainer_process passes this process's environment on (TRAINER_* reach the workers).
        mp.setenv("TRAINER_EXTRA_WORKER_SETUP_HOOK", f"{FAULTS}:skip_push_after_first")
        with trainer_process(tmp_path, *args) as (driver, tag):
            mp.undo()
            yield driver, tag, run_dir


def _first_rows(driver: subprocess.Popen, run_dir: Path, n: int) -> list[dict]:
    """The run's first ``n`` steps' metrics, once logged; fails with its output if it ended first."""
    metrics = run_dir / "metrics.jsonl"
    wait_until(
        lambda: (
            driver.poll() is not None
            or (metrics.exists() and len(metrics.read_text().splitlines()) >= n)
        ),
        400,  # the separate 4-step run had hang_guard(400) for all of it
        f"{n} steps",
    )
    assert driver.poll() is None, output_of_ended(driver)
    return _metrics(run_dir)[:n]


def test_a_broken_sync_fails_the_mismatch_check_end_to_end(broken_run):
    """The same run with the push skipped after step 1, installed in the Ray workers.

    (All three faults of ``vllm_faults`` are caught on the worker's own step
    in ``test_vllm_engine.py``; this one goes through ``python -m trainer``.)
    """
    driver, _, run_dir = broken_run
    rows = _first_rows(driver, run_dir, 4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_in_sync(rows[:2])  # the first push happened
    with pytest.raises(AssertionError, match="per step"):
        assert_in_sync(rows)


def test_killing_a_worker_ends_the_run_and_leaves_no_process(broken_run):
    driver, tag, run_dir = broken_run
    wait_for_first_step(driver, run_dir)
    seen = tagged(tag)
    workers = [p for p in seen if "WorkerHost" in " ".join(p.cmdline())]
    assert len(workers) == 2, [p.cmdline() for p in seen]
    # The engines run inside the workers: vLLM started no engine or worker process.
    # The one child a worker may have is Python's multiprocessing resource tracker,
    # which exits when its parent does; it carries the tag, so it is checked below.
    children = [c for w in workers for c in w.children(recursive=True)]
    assert all("resource_tracker" in " ".join(c.cmdline()) for c in children), [
        c.cmdline() for c in children
    ]
    seen += children
    workers[0].send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=hang_guard(180))
    assert driver.returncode != 0, out
    assert "died" in out or "Died" in out or "dead" in out, out[-3000:]
    assert_all_gone(tag, seen)
