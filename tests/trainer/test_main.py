"""Acceptance: ``python -m trainer`` as a user runs it, on tiny inputs."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from deadlines import hang_guard


def test_a_tiny_run_prints_where_its_outputs_are(trainer_cli, tmp_path):
    """Also: the address a crashed ``ray start`` left behind does not stop a fresh run."""
    run_dir = tmp_path / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray socket paths must stay short
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # nothing listens
    proc = trainer_cli(
        "algo=grpo",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=2",
        "trainer.val_every=1",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2",
        "rollout.n=2",
        "data.num_val_examples=4",
        "data.num_train_examples=16",
        env={"RAY_TMPDIR": str(ray_tmp)},
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(
        r"^trainer: done: 2 steps in [\d.]+ s, final train reward [\d.]+$", out, re.M
    ), out
    assert re.search(
        r"^trainer: val/reward_mean [\d.]+ \(sampled at temperature 1, 1 sample\(s\) per prompt\)$",
        out,
        re.M,
    )
    metrics = Path(re.search(r"^trainer: metrics: (.+)$", out, re.M).group(1))
    curve = Path(re.search(r"^trainer: reward curve: (.+)$", out, re.M).group(1))
    assert metrics == run_dir / "metrics.jsonl" and curve == run_dir / "reward_curve.png"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in (
        "rollout/reward_mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/approx_kl",
        "val/reward_mean",
        "timing/step",
        "perf/tokens_per_s",
    ):
        assert key in rows[-1], key
    assert_controller_figures(rows)
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").read_text().startswith("algo: grpo")


def assert_controller_figures(rows: list[dict]) -> None:
    """Every step's cost of the controller adds up, and its bytes are the batch's at most."""
    for row in rows:
        step = row["timing/step"]
        controller = row["timing/controller"]
        assert 0 <= controller <= step, row
        assert controller == pytest.approx(row["timing/serialize"] + row["timing/call_latency"])
        parts = controller + row["timing/worker_compute"] + row["timing/driver_math"]
        assert parts == pytest.approx(step), row
        assert 0 <= row["timing/copies"] <= row["timing/worker_compute"]
        sent, received = row["perf/driver_bytes_sent"], row["perf/driver_bytes_received"]
        assert row["perf/driver_bytes"] == sent + received
        # The batch stays with the workers: no tensor crosses the driver twice, so the
        # driver moves at most the batch's bytes (prompts out, what its math reads back in).
        assert 0 < row["perf/driver_bytes"] <= row["perf/batch_bytes"], row
        assert sent > 0 and received > 0
    assert rows[0]["timing/startup"] > 0  # the first row of a process: command to first step
    assert all("timing/startup" not in row for row in rows[1:])


def test_help_and_bad_overrides(trainer_cli):
    assert "usage: python -m trainer" in trainer_cli("--help").stdout
    bad = trainer_cli("data.train_batch_size=5", "actor.ppo_mini_batch_size=2")
    assert bad.returncode == 2
    assert "actor.ppo_mini_batch_size=2 does not divide data.train_batch_size=5" in bad.stderr


def test_a_bad_data_file_fails_at_start_naming_file_and_column(trainer_cli, tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"question": "1+1=", "ground_truth": "2"}) + "\n")
    proc = trainer_cli(
        f"data.train_files=[{f}]", f"trainer.run_dir={tmp_path / 'r'}", timeout=hang_guard(60)
    )
    assert proc.returncode != 0
    assert f"{f}: missing column 'prompt'" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr  # failed before starting Ray
