"""Where metrics go: JSON lines, a reward-curve PNG, and the trackers of ``trainer.loggers``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.logging.trackers import Tracker

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "reward_curve.png"


class MetricsLogger:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` and passes it to ``trackers``.

    Appending (not truncating) lets a resumed run continue the same file; the
    lines after the resume point are dropped first so no step appears twice.
    The trackers (:mod:`trainer.logging.trackers`, opened with the same ``resume_step``)
    get each row's finite values and are closed by :meth:`close`.
    """

    def __init__(
        self, run_dir: str | Path, trackers: Sequence[Tracker] = (), resume_step: int = 0
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif not resume_step:
            self.path.write_text("")
        self.trackers = list(trackers)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write ``metrics`` for ``step`` (non-finite floats become null; trackers skip them)."""
        row = {"step": step}
        for k, v in metrics.items():
            v = float(v)
            row[k] = v if math.isfinite(v) else None
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        finite = {k: v for k, v in row.items() if k != "step" and v is not None}
        for tracker in self.trackers:
            tracker.log(finite, step)

    def close(self) -> None:
        """Close every tracker (each once, even when one of them fails)."""
        trackers, self.trackers = self.trackers, []
        errors = []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:  # close the others; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_reward_curve(rows: list[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """Training and validation reward against step, saved as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows if r.get("rollout/reward_mean") is not None]
    ax.plot(
        steps,
        [r["rollout/reward_mean"] for r in rows if r.get("rollout/reward_mean") is not None],
        label="train reward (sampled)",
    )
    val = [(r["step"], r["val/reward_mean"]) for r in rows if r.get("val/reward_mean") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), marker="o", label="val reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    return _save_reward_axes(plt, fig, ax, out, title)


def plot_runs(runs: dict[str, list[dict[str, Any]]], out: str | Path, title: str = "") -> Path:
    """Validation reward of several runs against wall-clock seconds since start (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, rows in runs.items():
        pts = [
            (r["timing/wall"], r["val/reward_mean"])
            for r in rows
            if r.get("val/reward_mean") is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds since start (Ray start-up included)")
    ax.set_ylabel("val reward (sampled, T=1)")
    return _save_reward_axes(plt, fig, ax, out, title)


def _save_reward_axes(plt: Any, fig: Any, ax: Any, out: str | Path, title: str) -> Path:
    """Finish a reward plot the same way for every figure (range, grid, legend), save, close."""
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
