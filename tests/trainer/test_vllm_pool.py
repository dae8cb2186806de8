"""vLLM on a rollout pool of its own: the synchronous schedule is the colocated run, pushes reset the cache.

``python -m trainer rollout.engine=vllm`` on CPU twice, in the actor's
workers and on a rollout pool (``rollout.workers=1``): update for update the
same run. A push whose prefix-cache reset is skipped shows in its
acknowledgement. (The colocated engine's own checks: ``test_vllm_training.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deadlines import hang_guard
from test_vllm_engine import _cpu_vllm  # noqa: E402  (same skip rule)
from test_vllm_training import FAULTS, RUN, _metrics
from vllm_faults import assert_in_sync

pytestmark = pytest.mark.skipif(_cpu_vllm() is not None, reason=str(_cpu_vllm()))


def _final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    (path,) = (run_dir / "final_model").glob("*.safetensors")
    return load_file(path)


def test_k0_on_a_rollout_pool_is_the_colocated_vllm_trainer_update_for_update(
    trainer_cli, tmp_path
):
    """The same run twice, vLLM in the actor's worker or on a rollout pool of its own."""
    one = (*RUN, "trainer.total_steps=2", "trainer.num_workers=1")
    runs = {"colocated": (), "pooled": ("rollout.workers=1",)}
    rows, weights = {}, {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        proc = trainer_cli(*one, *extra, f"trainer.run_dir={run_dir}", timeout=hang_guard(400))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows[name], weights[name] = _metrics(run_dir), _final_weights(run_dir)
    for step, (a, b) in enumerate(zip(rows["colocated"], rows["pooled"], strict=True), 1):
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout/reward_mean"):
            assert a[key] == b[key], f"step {step}: {key} {a[key]} != {b[key]}"
        assert b["async/lag_max"] == 0
    assert_in_sync(rows["pooled"])
    acks = [r["async/prefix_cache_reset"] for r in rows["pooled"] if "async/push_s" in r]
    assert acks and set(acks) == {1.0}, acks  # every push dropped vLLM's prefix cache
    for name, tensor in weights["colocated"].items():
        assert torch.equal(tensor, weights["pooled"][name]), name


def test_a_skipped_prefix_cache_reset_shows_in_the_push_acknowledgement(trainer_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = trainer_cli(
        *RUN,
        "trainer.total_steps=3",
        "trainer.num_workers=1",
        "rollout.staleness=1",
        f"trainer.run_dir={run_dir}",
        env={"TRAINER_EXTRA_WORKER_SETUP_HOOK": f"{FAULTS}:skip_prefix_cache_reset"},
        timeout=hang_guard(400),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    acks = [r["async/prefix_cache_reset"] for r in _metrics(run_dir) if "async/push_s" in r]
    assert len(acks) >= 2 and set(acks) == {0.0}, acks  # every push skipped the reset
