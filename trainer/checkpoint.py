"""Atomic checkpoints of a whole run, and finding the one to resume from.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<NNNNNN>`` holding the
workers' files (model, optimizer, scheduler, per-rank RNG states: see
:mod:`trainer.workers.state`) and ``driver.pt`` (step, data position, KL
controller, driver RNG states). It is written under a hidden temporary name
and renamed into place only when complete, so a run killed mid-save leaves
either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d{6,})$")
DRIVER_FILE = "driver.pt"


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    driver_state: dict[str, Any],
    save_workers: Callable[[str], None],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically and return its directory.

    ``save_workers(tmp_dir)`` makes every worker write its files into the
    temporary directory; then the driver state is written and the directory
    renamed to its final name. Only the newest ``keep`` checkpoints are kept.
    """
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
    try:
        save_workers(str(tmp))
        torch.save({"step": step, **driver_state}, tmp / DRIVER_FILE)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest first (temporary ones are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / DRIVER_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint ``trainer.resume`` points at: never -> None, auto -> latest (or None)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / DRIVER_FILE).is_file():
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: not a checkpoint directory (no {DRIVER_FILE})"
        )
    return path


def load_driver_state(path: str | Path) -> dict[str, Any]:
    """The driver part of checkpoint ``path``."""
    return torch.load(Path(path) / DRIVER_FILE, map_location="cpu", weights_only=False)
