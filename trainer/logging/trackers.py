"""Experiment trackers a run logs to besides ``metrics.jsonl``: TensorBoard, W&B, MLflow.

``trainer.loggers`` names them. Each tracker's package is an extra of the
distribution (``pip install 'pytest-gpusched[wandb]'``) and is imported only
when the tracker is opened; :func:`problem` tells configuration validation,
before Ray starts, that a chosen one cannot be opened here.

Every tracker has the same two methods (:class:`Tracker`): ``log(metrics,
step)`` with finite floats only, and ``close()``. :class:`trainer.logging.metrics.MetricsLogger`
opens none itself: ``python -m trainer`` opens them with :func:`open_trackers`
and hands them over, and the logger passes each step to each.

Resuming (``resume_step > 0``: the run continues from the checkpoint of that
step). The attempt that stopped may have logged steps after the checkpoint;
each step must reach a tracker once:

- TensorBoard: the new writer starts with ``purge_step=resume_step + 1``;
  TensorBoard's readers drop the earlier files' events from that step on, so
  the resumed attempt's values replace them (as in ``metrics.jsonl``).
- MLflow: the run continues under the id kept in ``<run_dir>/trackers.json``.
  MLflow cannot delete a point, so steps the run already holds are skipped and
  keep the stopped attempt's values (the same numbers except timings: a resumed
  run repeats its steps exactly).
- W&B: the run continues under the id kept in ``<run_dir>/trackers.json``
  (``resume="allow"``). Online, W&B itself ignores a step below the run's
  current one, which again keeps the stopped attempt's values. Offline, each
  attempt writes its own ``offline-run-*`` directory under that id, the
  resumed one from ``resume_step + 1``; ``wandb sync`` uploads them in order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gpusched import DISTRIBUTION

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The names ``trainer.loggers`` accepts; the extra of each has the same name."""
IDS_FILE = "trackers.json"
"""``{"wandb": run id, "mlflow": run id}``: what a resumed run continues."""
MLFLOW_DB = "mlflow.db"


class Tracker(Protocol):
    """One experiment tracker of a run."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (finite floats) at ``step``."""

    def close(self) -> None:
        """Flush and end the tracker's run; called once, also when training failed."""


def _modules(name: str) -> tuple[str, ...]:
    """The importable packages tracker ``name`` needs in this environment."""
    if name == "mlflow":
        # The default store is SQLite in the run directory: MLflow's SQL store needs these.
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        return ("mlflow", "sqlalchemy", "alembic") if local else ("mlflow",)
    return (name,)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec: imported somehow, so present
        return True


def problem(name: str) -> str | None:
    """Why ``trainer.loggers`` cannot name ``name`` here (unknown, or a package missing), or None."""
    if name not in TRACKERS:
        return (
            f"trainer.loggers: unknown tracker {name!r}: choose from {', '.join(TRACKERS)} "
            "(metrics.jsonl and reward_curve.png are always written)"
        )
    for module in _modules(name):
        if not _installed(module):
            return (
                f"trainer.loggers: {name!r} needs the {module} package: "
                f"pip install '{DISTRIBUTION}[{name}]'"
            )
    return None


def chosen(loggers: Sequence[str], tensorboard_if_installed: bool) -> list[str]:
    """The trackers a run opens: ``loggers`` once each, plus TensorBoard when
    ``tensorboard_if_installed`` (``trainer.tensorboard``) and its package is there."""
    names = list(dict.fromkeys(loggers))
    if tensorboard_if_installed and "tensorboard" not in names and _installed("tensorboard"):
        names.append("tensorboard")
    return names


def open_trackers(
    names: Sequence[str],
    run_dir: str | Path,
    *,
    project: str,
    experiment: str,
    resume_step: int = 0,
    config: dict[str, Any] | None = None,
) -> list[Tracker]:
    """Open the trackers ``names`` for the run in ``run_dir`` (closing those opened if one fails).

    ``project`` is the W&B project and the MLflow experiment, ``experiment`` the
    run's name in both; ``resume_step > 0`` continues the run recorded in
    ``run_dir`` from that checkpoint's step; ``config`` is recorded with the run.
    """
    run_dir = Path(run_dir)
    opened: list[Tracker] = []
    try:
        for name in names:
            match name:
                case "tensorboard":
                    opened.append(TensorBoardTracker(run_dir, resume_step))
                case "wandb":
                    opened.append(WandbTracker(run_dir, project, experiment, resume_step, config))
                case "mlflow":
                    opened.append(MlflowTracker(run_dir, project, experiment, resume_step, config))
                case _:
                    raise ValueError(problem(name))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened


def stored_id(run_dir: Path, tracker: str) -> str | None:
    """The run id ``tracker`` recorded in ``run_dir``, if any."""
    path = run_dir / IDS_FILE
    return json.loads(path.read_text()).get(tracker) if path.exists() else None


def _store_id(run_dir: Path, tracker: str, run_id: str) -> None:
    path = run_dir / IDS_FILE
    ids = json.loads(path.read_text()) if path.exists() else {}
    ids[tracker] = run_id
    path.write_text(json.dumps(ids, indent=1) + "\n")


class TensorBoardTracker:
    """Scalars in ``<run_dir>/tensorboard/`` (``torch.utils.tensorboard``)."""

    def __init__(self, run_dir: Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A START marker at purge_step: readers drop the events of earlier files at steps
        # >= it (a fresh run: all of them, from a run that used this directory before).
        purge = resume_step + 1 if resume_step else 0
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run under ``<run_dir>/wandb/``; ``WANDB_MODE`` and W&B's login decide where it goes."""

    def __init__(
        self,
        run_dir: Path,
        project: str,
        name: str,
        resume_step: int = 0,
        config: dict[str, Any] | None = None,
    ) -> None:
        import wandb

        run_id = stored_id(run_dir, "wandb") if resume_step else None
        self.run = wandb.init(
            dir=str(run_dir),
            project=project,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            allow_val_change=True,  # a resumed run may change total_steps
        )
        _store_id(run_dir, "wandb", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run at ``MLFLOW_TRACKING_URI``, else in ``<run_dir>/mlflow.db`` (SQLite).

    Experiment ``project``, run name ``name``; the configuration is logged as
    the run's parameters when the run is created (a resumed run keeps them:
    MLflow parameters cannot change).
    """

    def __init__(
        self,
        run_dir: Path,
        project: str,
        name: str,
        resume_step: int = 0,
        config: dict[str, Any] | None = None,
    ) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
        self.client = MlflowClient(uri)
        self.tracking_uri = uri
        self.logged_through = -1
        """Steps up to this one the run already holds (from an earlier attempt): skipped."""
        run_id = stored_id(run_dir, "mlflow") if resume_step else None
        if run_id is not None:
            try:
                held = self.client.get_run(run_id)
            except MlflowException:  # not in this store (MLFLOW_TRACKING_URI changed)
                run_id = None
            else:
                self.logged_through = max(
                    (
                        m.step
                        for key in held.data.metrics
                        for m in self.client.get_metric_history(run_id, key)
                    ),
                    default=-1,
                )
                self.client.update_run(run_id, status="RUNNING")
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(
                    project,
                    artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
                    if local
                    else None,
                )
            )
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flatten(config or {}).items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 parameters per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
        self.run_id = run_id
        _store_id(run_dir, "mlflow", run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_through:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """``key`` with each character MLflow refuses in a metric name (``@``, ``+``, ...) as ``_``."""
    return re.sub(r"[^/\w.\- :]", "_", key)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
