"""Atomic checkpoints of a whole run, and finding the one to resume from.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<NNNNNN>``::

    format.json     format name and version, trainer version, step, roles  (driver, last)
    driver.json     step, data position, KL controller, driver RNG states  (driver)
    actor/          the actor's sharded state, see trainer.workers.state   (every rank)
    critic/         the same for the critic, when there is one

It is written under a hidden temporary name and renamed into place only when
every worker's write has finished, so a run killed mid-save (or a background
write that failed) leaves the previous checkpoint whole and no new one. Only
directories holding ``format.json`` count as checkpoints. Nothing here is
unpickled: the driver's files are JSON.

:class:`CheckpointWriter` is the driver's side of an asynchronous save: the
workers return once their state is staged in host memory, the directory is
committed (renamed) when they report the write finished, at the next step,
the next save or the end of the run.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import __version__
from trainer.checkpoints.files import (
    FORMAT,
    FORMAT_VERSION,
    ROLE_STATE_FILE,
    CheckpointError,
    check_format,
    read_json,
    reject_old_layout,
    write_json,
)

__all__ = [
    "DRIVER_FILE",
    "FORMAT_FILE",
    "CheckpointError",
    "CheckpointWriter",
    "begin_checkpoint",
    "checkpoint_root",
    "commit_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_driver_state",
    "resolve_resume",
    "save_checkpoint",
]

_NAME = re.compile(r"^step_(\d{6,})$")
DRIVER_FILE = "driver.json"
FORMAT_FILE = "format.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


def begin_checkpoint(run_dir: str | Path, step: int, driver_state: dict[str, Any]) -> Path:
    """Make the temporary directory of checkpoint ``step`` and write the driver's state into it.

    ``driver_state`` must be JSON-able (:meth:`trainer.loop.ppo.PPOTrainer.state_dict` is);
    it is written now, so it is the state at the save, however late the commit.
    """
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
    try:
        write_json(tmp / DRIVER_FILE, {"step": step, **driver_state})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def commit_checkpoint(run_dir: str | Path, tmp: Path, step: int, keep: int = 2) -> Path:
    """Write ``format.json`` into the finished ``tmp`` and rename it to ``step_<step>``.

    Only the newest ``keep`` checkpoints are kept (0 keeps all). Returns the final path.
    """
    final = checkpoint_root(run_dir) / f"step_{step:06d}"
    roles = sorted(p.name for p in tmp.iterdir() if (p / ROLE_STATE_FILE).is_file())
    write_json(
        tmp / FORMAT_FILE,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "trainer_version": __version__,
            "step": step,
            "roles": roles,
        },
    )
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    driver_state: dict[str, Any],
    save_workers: Callable[[str], None],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` synchronously and atomically; return its directory.

    ``save_workers(tmp_dir)`` makes every worker write its files into the
    temporary directory and returns when they are written. On any error the
    temporary directory is removed and the previous checkpoints stay as they were.
    """

    def save_now(d: str, _: bool | str) -> bool:
        save_workers(d)
        return False

    writer = CheckpointWriter(run_dir, save_now, lambda: None, keep)
    return writer.save(step, driver_state, asynchronous=False)


class CheckpointWriter:
    """The driver's checkpoints, synchronous or asynchronous; at most one in flight.

    ``save_workers(tmp_dir, asynchronous)`` asks every worker to save, passing
    ``trainer.async_save`` on (each worker resolves ``auto`` for its own device,
    :func:`trainer.workers.state.background_save`), and returns whether any
    write is still running in the background; ``wait_workers()`` returns when
    every worker's background write has ended and raises if one failed. A
    save no worker wrote in the background is committed at once.
    """

    def __init__(
        self,
        run_dir: str | Path,
        save_workers: Callable[[str, bool | str], bool],
        wait_workers: Callable[[], None],
        keep: int = 2,
    ) -> None:
        self.run_dir = Path(run_dir)
        self._save_workers = save_workers
        self._wait_workers = wait_workers
        self.keep = keep
        self._pending: tuple[int, Path] | None = None

    def save(
        self, step: int, driver_state: dict[str, Any], asynchronous: bool | str
    ) -> Path | None:
        """Checkpoint ``step``: committed now (its path is returned), or at the next :meth:`wait`
        when a worker still writes in the background."""
        self.wait()
        tmp = begin_checkpoint(self.run_dir, step, driver_state)
        try:
            in_flight = self._save_workers(str(tmp), asynchronous)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = (step, tmp)
        return None if in_flight else self.wait()

    def wait(self) -> Path | None:
        """Finish the checkpoint in flight: wait for the workers, then commit it.

        Raises :class:`CheckpointError` naming the checkpoint when a worker's
        (background) write failed; its temporary directory is removed and the
        previous checkpoint is left as the latest. Returns the committed path.
        """
        if self._pending is None:
            return None
        step, tmp = self._pending
        self._pending = None
        try:
            self._wait_workers()
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint step_{step:06d} of {self.run_dir} was not saved: a worker's write "
                f"failed ({_first_line(exc)}); the latest complete checkpoint is "
                f"{latest_checkpoint(self.run_dir) or 'none'}"
            ) from exc
        try:
            return commit_checkpoint(self.run_dir, tmp, step, self.keep)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @property
    def pending_step(self) -> int | None:
        """The step of the checkpoint being written in the background, if any."""
        return None if self._pending is None else self._pending[0]


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    hit = next((line for line in lines if "checkpoint" in line), lines[0] if lines else "")
    return f"{type(exc).__name__}: {hit.strip()}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest first (temporary ones are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / FORMAT_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint ``trainer.resume`` points at: never -> None, auto -> latest (or None).

    A named directory is checked now (format and version), so a wrong or
    foreign checkpoint fails before any worker starts.
    """
    if resume == "never":
        return None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        if path is None:
            _refuse_old_layouts(run_dir)
    else:
        path = Path(resume)
        if not path.is_dir():
            raise FileNotFoundError(f"trainer.resume={resume!r}: not a checkpoint directory")
        reject_old_layout(path)
        if not (path / FORMAT_FILE).is_file():
            raise FileNotFoundError(
                f"trainer.resume={resume!r}: not a checkpoint directory (no {FORMAT_FILE}: "
                "incomplete, or not a checkpoint)"
            )
    if path is not None:
        check_format(path / FORMAT_FILE, read_json(path / FORMAT_FILE))
    return path


def _refuse_old_layouts(run_dir: str | Path) -> None:
    """``resume=auto`` over a run directory holding only old-layout checkpoints: say so."""
    root = checkpoint_root(run_dir)
    old = sorted(p for p in root.glob("step_*") if _NAME.match(p.name)) if root.is_dir() else []
    if old:
        reject_old_layout(old[-1])


def load_driver_state(path: str | Path) -> dict[str, Any]:
    """The driver part of checkpoint ``path`` (format checked first)."""
    p = Path(path)
    reject_old_layout(p)
    check_format(p / FORMAT_FILE, read_json(p / FORMAT_FILE))
    state = read_json(p / DRIVER_FILE)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{p / DRIVER_FILE}: corrupted (no step)")
    return state
