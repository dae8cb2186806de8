"""Checkpoint files: atomic writes, pruning, resolving what to resume from, and whether a
worker's save writes in the background (``trainer.async_save``)."""

from __future__ import annotations

import pytest

from trainer.checkpoints.store import (
    latest_checkpoint,
    list_checkpoints,
    load_driver_state,
    resolve_resume,
    save_checkpoint,
)
from trainer.config import ConfigError, load_config
from trainer.workers.state import background_save


def _save_workers(d: str) -> None:
    with open(f"{d}/actor_weights", "w") as fh:
        fh.write("weights")


def test_save_is_atomic_and_latest_is_found(tmp_path):
    first = save_checkpoint(tmp_path, 3, {"loader": {"epoch": 0, "position": 12}}, _save_workers)
    assert first.name == "step_000003" and (first / "actor_weights").read_text() == "weights"
    assert load_driver_state(first) == {"step": 3, "loader": {"epoch": 0, "position": 12}}
    second = save_checkpoint(tmp_path, 6, {}, _save_workers)
    assert latest_checkpoint(tmp_path) == second
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] != []
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    save_checkpoint(tmp_path, 1, {}, _save_workers)

    def boom(d: str) -> None:
        _save_workers(d)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {}, boom)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]
    assert latest_checkpoint(tmp_path).name == "step_000001"


def test_incomplete_and_temporary_directories_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_000009-abc").mkdir(parents=True)
    (root / "step_000007").mkdir()  # no format.json: a partial copy, not a checkpoint
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path) is None


def test_only_the_newest_are_kept(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, {}, _save_workers, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000006", "step_000008"]


def test_resolve_resume(tmp_path):
    assert resolve_resume("never", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: start fresh
    saved = save_checkpoint(tmp_path, 5, {}, _save_workers)
    assert resolve_resume("auto", tmp_path) == saved
    assert resolve_resume(str(saved), tmp_path) == saved
    with pytest.raises(FileNotFoundError, match="trainer.resume=.*not a checkpoint"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(None, "auto"), ("auto", "auto"), ("true", "True"), ("false", "False"), ("no", "False")],
)
def test_async_save_accepts_auto_true_and_false(value, parsed):
    cfg = load_config([] if value is None else [f"trainer.async_save={value}"])
    assert cfg.trainer.async_save == parsed


@pytest.mark.parametrize("value", ["sometimes", "2"])
def test_a_bad_async_save_names_the_key_and_the_choices(value):
    with pytest.raises(
        ConfigError, match=r"^trainer.async_save=.*: choose 'auto', 'true' or 'false'$"
    ):
        load_config([f"trainer.async_save={value}"])
    with pytest.raises(ConfigError, match=r"^trainer.async_save="):
        load_config([], base={"trainer": {"async_save": value}})


@pytest.mark.parametrize(
    ("setting", "device", "background"),
    [
        ("auto", "cpu", False),  # the write would compete with the step for the cores
        ("auto", "cuda", True),  # device-to-host copy, the write overlaps GPU compute
        ("True", "cpu", True),  # as parsed from trainer.async_save=true
        ("false", "cuda", False),
        (True, "cpu", True),  # a TrainerConfig built in Python
        (False, "cuda", False),
    ],
)
def test_auto_is_sync_on_a_cpu_worker_and_async_on_a_cuda_one(setting, device, background):
    assert background_save(setting, device) is background


def test_a_bad_setting_at_the_worker_names_the_key():
    with pytest.raises(ValueError, match=r"trainer.async_save='sometimes': choose one of"):
        background_save("sometimes", "cpu")
