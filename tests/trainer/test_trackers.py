"""Experiment trackers (``trainer.loggers``): every step read back through each library's own reader.

TensorBoard through ``EventAccumulator``, MLflow through
``MlflowClient.get_metric_history``, W&B (offline: nothing leaves the machine)
through ``wandb leet inspect --json``, W&B's reader of a run's ``.wandb``
transaction log. Each is compared with ``metrics.jsonl``, row by row.

Unit level: one tracker at a time; a resume after a stop between checkpoints;
a fresh run in a used run directory; the errors for an unknown tracker or a
missing package. End to end: ``python -m trainer`` with all three trackers,
stopped at a checkpoint and continued with ``trainer.resume=auto``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from deadlines import hang_guard

from trainer.config import ConfigError, load_config
from trainer.logging.metrics import MetricsLogger, read_metrics
from trainer.logging.trackers import (
    DISTRIBUTION,
    MLFLOW_DB,
    TRACKERS,
    chosen,
    open_trackers,
    problem,
    stored_id,
)

PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
Rows = dict[int, dict[str, float]]


def need_extra(tracker: str) -> None:
    """Skip the test unless ``tracker``'s package is installed, naming the extra that installs it."""
    pytest.importorskip(
        PACKAGE[tracker],
        reason=f"needs the {tracker} extra: pip install '{DISTRIBUTION}[{tracker}]'",
    )


def offline_env(home: Path) -> dict[str, str]:
    """W&B offline and quiet with every file of its own under ``home``; MLflow in the run dir."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(home),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_DATA_DIR": str(home / "data"),
        "MLFLOW_TRACKING_URI": "",  # empty: the default SQLite store in the run directory
    }


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in offline_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(name, value)


# --- readers: each tracker's own library, never our code ---------------------------------


def jsonl_rows(run_dir: Path) -> Rows:
    """``metrics.jsonl`` as step -> finite values (what the trackers are given)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len({r["step"] for r in rows}) == len(rows), "a step twice in metrics.jsonl"
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and v is not None} for r in rows}


def _rows(points: list[tuple[int, str, float]]) -> Rows:
    """step -> {key: value}, failing on a (step, key) recorded twice."""
    twice = [p for p, n in Counter((s, k) for s, k, _ in points).items() if n > 1]
    assert not twice, f"recorded more than once: {twice[:5]}"
    rows: Rows = {}
    for step, key, value in points:
        rows.setdefault(step, {})[key] = value
    return rows


def tensorboard_rows(run_dir: Path) -> Rows:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return _rows(
        [(e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    )


def mlflow_run(run_dir: Path) -> tuple[Any, Any]:
    """The MLflow client of the run directory's store and the run it recorded."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / MLFLOW_DB}")
    return client, client.get_run(stored_id(run_dir, "mlflow"))


def mlflow_rows(run_dir: Path) -> Rows:
    client, run = mlflow_run(run_dir)
    return _rows(
        [
            (m.step, key, m.value)
            for key in run.data.metrics
            for m in client.get_metric_history(run.info.run_id, key)
        ]
    )


def wandb_files(run_dir: Path) -> list[tuple[str, Rows]]:
    """Each offline-run directory of the run, in start order: (run id, its history rows)."""
    files = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=hang_guard(30),
        )
        assert out.returncode == 0, out.stderr
        run_id, points = None, []
        for line in out.stdout.splitlines():
            record = json.loads(line)
            if record["type"] == "run":
                run_id = record["run"]["run_id"]
            elif record["type"] == "history":
                step = record["history"]["step"].get("num", 0)
                item = record["history"]["item"]
                points += [(step, k, v) for k, v in item.items() if not k.startswith("_")]
        files.append((run_id, _rows(points)))
    return files


def assert_rows_equal(got: Rows, want: Rows, rel: float, tracker: str) -> None:
    assert sorted(got) == sorted(want), f"{tracker}: steps {sorted(got)} != {sorted(want)}"
    for step, row in want.items():
        assert sorted(got[step]) == sorted(row), f"{tracker}: keys of step {step} differ"
        for key, value in row.items():
            assert got[step][key] == pytest.approx(value, rel=rel), f"{tracker}: {key}@{step}"


TOLERANCE = {"tensorboard": 1e-6, "wandb": 1e-12, "mlflow": 1e-12}  # TensorBoard keeps float32


def read_back(tracker: str, run_dir: Path, wandb: list[tuple[str, Rows]] | None = None) -> Rows:
    """Every step ``tracker`` holds for the run (W&B: all its offline files, which must agree;
    ``wandb``: what :func:`wandb_files` read of them already, else they are read now)."""
    if tracker == "tensorboard":
        return tensorboard_rows(run_dir)
    if tracker == "mlflow":
        return mlflow_rows(run_dir)
    merged: Rows = {}
    for _, rows in wandb_files(run_dir) if wandb is None else wandb:
        assert not set(rows) & set(merged), "W&B: a step in two offline files"
        merged.update(rows)
    return merged


def _metrics(step: int, attempt: int = 0) -> dict[str, float]:
    return {
        "rollout/reward_mean": step / 10 + attempt,
        "actor/pg_loss": -1.5e-3 * step + attempt,
        "val/reward_mean": math.nan if step % 2 else 0.25 * step,  # non-finite: skipped
        "perf/tokens_per_s": 12345.678 * step,
    }


def _attempt(run_dir: Path, names: list[str], steps: range, resume_step: int, attempt: int):
    trackers = open_trackers(
        names, run_dir, project="tests", experiment="attempt", resume_step=resume_step, config={}
    )
    logger = MetricsLogger(run_dir, trackers, resume_step=resume_step)
    try:
        for step in steps:
            logger.log(_metrics(step, attempt), step)
    finally:
        logger.close()


# --- unit level ----------------------------------------------------------------------------


@pytest.mark.parametrize("tracker", TRACKERS)
def test_a_tracker_holds_every_step_of_metrics_jsonl(tracker, tmp_path, tracker_env):
    need_extra(tracker)
    run_dir = tmp_path / "run"
    _attempt(run_dir, [tracker], range(0, 5), resume_step=0, attempt=0)
    want = jsonl_rows(run_dir)
    assert sorted(want) == [0, 1, 2, 3, 4] and "val/reward_mean" not in want[1]
    assert_rows_equal(read_back(tracker, run_dir), want, TOLERANCE[tracker], tracker)


def test_a_resume_after_a_stop_between_checkpoints_logs_each_step_once(tmp_path, tracker_env):
    """Attempt 1 logs steps 1-5 and stops; attempt 2 resumes from the step-3 checkpoint.

    metrics.jsonl and TensorBoard (purge_step) hold attempt 2's steps 4-5; MLflow
    continues the same run and keeps attempt 1's steps 4-5 (it cannot delete a
    point), logging from step 6; W&B continues the same run id, each attempt in
    its own offline directory, in the order ``wandb sync`` uploads them.
    """
    for tracker in PACKAGE:
        need_extra(tracker)
    run_dir = tmp_path / "run"
    _attempt(run_dir, list(TRACKERS), range(1, 6), resume_step=0, attempt=0)
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    _attempt(run_dir, list(TRACKERS), range(4, 8), resume_step=3, attempt=1)
    assert json.loads((run_dir / "trackers.json").read_text()) == first_ids

    jsonl = jsonl_rows(run_dir)
    assert sorted(jsonl) == list(range(1, 8))
    assert jsonl[4]["rollout/reward_mean"] == pytest.approx(1.4)  # attempt 2's value
    assert_rows_equal(tensorboard_rows(run_dir), jsonl, TOLERANCE["tensorboard"], "tensorboard")

    attempt_1 = {s: {k: v for k, v in _metrics(s).items() if math.isfinite(v)} for s in (4, 5)}
    assert_rows_equal(mlflow_rows(run_dir), {**jsonl, **attempt_1}, 1e-12, "mlflow")
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == first_ids["mlflow"] and run.info.status == "FINISHED"

    (id_1, rows_1), (id_2, rows_2) = wandb_files(run_dir)
    assert id_1 == id_2 == first_ids["wandb"]
    assert sorted(rows_1) == [1, 2, 3, 4, 5] and sorted(rows_2) == [4, 5, 6, 7]
    assert_rows_equal(rows_2, {s: jsonl[s] for s in (4, 5, 6, 7)}, 1e-12, "wandb")


def test_a_fresh_run_in_a_used_directory_starts_new_tracker_runs(tmp_path, tracker_env):
    for tracker in PACKAGE:
        need_extra(tracker)
    run_dir = tmp_path / "run"
    _attempt(run_dir, list(TRACKERS), range(1, 4), resume_step=0, attempt=0)
    old = json.loads((run_dir / "trackers.json").read_text())
    _attempt(run_dir, list(TRACKERS), range(1, 3), resume_step=0, attempt=1)
    new = json.loads((run_dir / "trackers.json").read_text())
    assert new["wandb"] != old["wandb"] and new["mlflow"] != old["mlflow"]
    jsonl = jsonl_rows(run_dir)
    assert sorted(jsonl) == [1, 2]
    for tracker in ("tensorboard", "mlflow"):  # TensorBoard: the old run's events are purged
        assert_rows_equal(read_back(tracker, run_dir), jsonl, TOLERANCE[tracker], tracker)
    assert [run_id for run_id, _ in wandb_files(run_dir)] == [old["wandb"], new["wandb"]]


@pytest.mark.parametrize(
    ("tracker", "absent", "tracking_uri"),
    [
        ("wandb", "wandb", ""),
        ("tensorboard", "tensorboard", ""),
        ("mlflow", "mlflow", ""),
        ("mlflow", "sqlalchemy", ""),  # the default store is SQLite: MLflow's SQL store needs it
        ("mlflow", "mlflow", "http://127.0.0.1:9"),
    ],
)
def test_a_tracker_whose_package_is_missing_is_a_config_error(
    tracker, absent, tracking_uri, monkeypatch
):
    if absent != tracker:
        need_extra(tracker)  # the tracker's own package present, only `absent` missing
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setitem(sys.modules, absent, None)  # import (and find_spec) now fail
    with pytest.raises(ConfigError) as info:
        load_config([f"trainer.loggers=[{tracker}]"])
    assert str(info.value) == (
        f"trainer.loggers: {tracker!r} needs the {absent} package: "
        f"pip install '{DISTRIBUTION}[{tracker}]'"
    )


def test_a_remote_mlflow_store_does_not_need_the_sql_packages(monkeypatch):
    need_extra("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    assert problem("mlflow") is None


def test_unknown_trackers_are_named():
    with pytest.raises(ConfigError, match=r"unknown tracker 'console': choose from tensorboard, "):
        load_config(["trainer.loggers=[console]"])
    assert load_config([]).trainer.loggers == []


def test_tensorboard_named_and_switched_off_is_a_contradiction():
    need_extra("tensorboard")  # without it, the missing package is the error reported first
    with pytest.raises(ConfigError, match=r"trainer.loggers .* trainer.tensorboard=false"):
        load_config(["trainer.loggers=[tensorboard]", "trainer.tensorboard=false"])


def test_tensorboard_is_added_when_installed_unless_switched_off(monkeypatch):
    assert chosen(["wandb", "wandb"], tensorboard_if_installed=False) == ["wandb"]
    assert chosen(["tensorboard", "mlflow"], True) == ["tensorboard", "mlflow"]
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert chosen(["mlflow"], tensorboard_if_installed=True) == ["mlflow"]


def test_mlflow_gets_keys_it_accepts():
    from trainer.logging.trackers import _mlflow_key

    assert _mlflow_key("actor/pg_clipfrac") == "actor/pg_clipfrac"
    assert _mlflow_key("val/tools/web search:v2/calls") == "val/tools/web search:v2/calls"
    assert _mlflow_key("val/pass@k+1") == "val/pass_k_1"


def test_the_cli_refuses_a_missing_tracker_before_ray_starts(tmp_path):
    """Exit status 2 and one line naming the extra; neither Ray nor torch was imported."""
    script = (
        "import sys; sys.modules['wandb'] = None\n"
        "from trainer.__main__ import main\n"
        f"rc = main(['trainer.loggers=[wandb]', 'trainer.run_dir={tmp_path / 'run'}'])\n"
        "print('imported:', sorted({'ray', 'torch'} & set(sys.modules)))\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=hang_guard(60)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "trainer: error: trainer.loggers: 'wandb' needs the wandb package: "
        "pip install 'pytest-gpusched[wandb]'"
    )
    assert proc.stdout.strip() == "imported: []"
    assert not (tmp_path / "run").exists()


# --- end to end ----------------------------------------------------------------------------


def test_a_resumed_cli_run_logs_every_step_once_to_every_tracker(trainer_cli, tmp_path):
    """3 steps with a step-3 checkpoint, then ``trainer.resume=auto`` to step 6: each
    tracker holds steps 1-6 once, equal to metrics.jsonl, W&B and MLflow in one run each."""
    for tracker in PACKAGE:
        need_extra(tracker)
    run_dir = tmp_path / "run"
    env = offline_env(tmp_path / "wandb-home")

    def train(total: int, resume: str) -> None:
        proc = trainer_cli(
            "algo=grpo",
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={total}",
            "trainer.save_every=3",
            f"trainer.resume={resume}",
            "trainer.val_every=2",
            "trainer.progress=false",
            "trainer.num_workers=1",
            "trainer.loggers=[wandb,mlflow,tensorboard]",
            "trainer.project_name=trackers-e2e",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=2",
            "data.num_train_examples=16",
            "data.num_val_examples=4",
            env=env,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    train(3, "never")
    ids = json.loads((run_dir / "trackers.json").read_text())
    train(6, "auto")
    assert json.loads((run_dir / "trackers.json").read_text()) == ids

    jsonl = jsonl_rows(run_dir)
    assert sorted(jsonl) == [1, 2, 3, 4, 5, 6] and "val/reward_mean" in jsonl[4]
    wandb = wandb_files(run_dir)  # one `wandb leet inspect` a file, for both checks below
    for tracker in TRACKERS:
        got = read_back(tracker, run_dir, wandb)
        assert_rows_equal(got, jsonl, TOLERANCE[tracker], tracker)

    assert [run_id for run_id, _ in wandb] == [ids["wandb"]] * 2
    client, run = mlflow_run(run_dir)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "trackers-e2e"
    assert run.data.params["trainer.total_steps"] == "3"  # parameters of the run's first start
