"""Saving and restoring a worker's training state with ``torch.distributed.checkpoint``.

Every rank of the role's group writes its own shard of the model and the
optimizer into ``<checkpoint>/<role>/`` (DCP's ``__<rank>_0.distcp`` files and
the ``.metadata`` index): no full gather, so a rank holds at most its shard
plus DCP's write buffer. The tensors are the sharded ``get_state_dict`` of
FSDP2 (DTensors) or, for ``ddp``, the whole replicated tensors, which DCP
writes once (spread over the ranks). Loading reads them back into however
many ranks the new run has: DCP reshards on read.

Beside the shards, as JSON (never a pickle, see :mod:`trainer.checkpoints.files`):
``state.json`` (rank 0: format version, world size, strategy, the optimizer's
hyper-parameters) and ``rank_<r>.json`` (each rank: its RNG states and the LR
scheduler). A rank of a resumed run with no file of its own (more ranks than
saved) keeps its seeded RNG; the scheduler is the same on every rank.

:class:`CheckpointSaver` is one role's saver in one process: with
``asynchronous=True`` it copies the state to host memory, returns, and writes
in a background thread over a process group of its own (the training step's
collectives run on the default group meanwhile); :meth:`CheckpointSaver.wait`
ends that write and raises :class:`CheckpointWriteError` naming the directory
if it failed. The next save waits for the previous one first. Whether a
worker's save is asynchronous is :func:`background_save` of ``trainer.async_save``
and the worker's device.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from trainer import __version__, fsdp
from trainer.checkpoints import rng
from trainer.checkpoints.files import (
    FORMAT,
    FORMAT_VERSION,
    ROLE_STATE_FILE,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_format,
    conform,
    describe,
    merge_non_tensors,
    rank_file,
    read_json,
    reject_old_layout,
    split_tensors,
    verify_dcp_dir,
    write_json,
)

__all__ = [
    "ASYNC_SAVE_CHOICES",
    "CheckpointSaver",
    "CheckpointWriteError",
    "background_save",
    "load_training_state",
    "set_write_hook",
]


ASYNC_SAVE_CHOICES = ("auto", "true", "false")
"""The values of ``trainer.async_save`` (a bool is read as its name)."""


def background_save(setting: str | bool, device_type: str) -> bool:
    """Whether a save on a ``device_type`` worker writes in the background (``trainer.async_save``).

    ``true`` and ``false`` decide alone. ``auto`` is asynchronous on CUDA, where
    staging is a device-to-host copy and the write overlaps GPU compute, and
    synchronous on CPU, where the background write competes with the next step
    for the same cores and costs the run more than it hides
    (``bench/checkpoint_memory.py``). ``device_type`` is the worker's own
    (:func:`trainer.workers.device.worker_device`: what Ray granted it).
    """
    value = str(setting).lower()
    if value not in ASYNC_SAVE_CHOICES:
        raise ValueError(f"trainer.async_save={setting!r}: choose one of {ASYNC_SAVE_CHOICES}")
    if value == "auto":
        return device_type == "cuda"
    return value == "true"


class CheckpointWriteError(RuntimeError):
    """A checkpoint's (background) write failed; the message names its directory."""


# A test-only seam: called as hook(directory, rank) on every rank just before it writes its
# shard (in the background thread for an asynchronous save). Tests use it to SIGKILL a rank
# mid-save or to make a write fail; None in production.
_write_hook: Callable[[Path, int], None] | None = None


def set_write_hook(hook: Callable[[Path, int], None] | None) -> None:
    """Install (or clear) the hook run before each rank writes its shard (tests only)."""
    global _write_hook
    _write_hook = hook


class _Writer(FileSystemWriter):
    """DCP's file writer: one file per rank, with the test seam before the data is written."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=True)
        self._dir, self._rank = path, rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        if _write_hook is not None:
            _write_hook(self._dir, self._rank)
        return super().write_data(plan, planner)


def _options() -> StateDictOptions:
    # Sharded (no gather) for FSDP2; plain tensors for ddp. Non-strict would hide a wrong model.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=True)


def _state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DCP tensors, JSON rest) of model and optimizer, sharded as they live on this rank."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_options())}, {}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    optim_tensors, optim_rest = split_tensors(optim_sd)
    tensors = {"model": model_sd}
    if optim_tensors:
        tensors["optim"] = optim_tensors
    return tensors, optim_rest


class CheckpointSaver:
    """Writes one role's training state from this rank; at most one write in flight.

    Every rank of the role's group calls :meth:`save` (and :meth:`wait`) with
    the same directory: DCP plans the write collectively.
    """

    def __init__(self, role: str, rank: int) -> None:
        self.role = role
        self.rank = rank
        self._pending: tuple[Path, Future] | None = None
        self._group: Any = None

    def _background_group(self) -> Any:
        """A gloo group of the same ranks for background writes (created collectively, once)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(
        self,
        directory: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        *,
        asynchronous: bool = False,
        extra: Callable[[Path], None] | None = None,
    ) -> None:
        """Write this rank's part of the state into ``<directory>/<role>``.

        Waits for the previous save first. ``extra(role_dir)`` runs on rank 0
        (the actor writes its config and tokenizer there for the export). With
        ``asynchronous``, returns once the tensors are copied to host memory.
        """
        self.wait()
        out = Path(directory) / self.role
        out.mkdir(parents=True, exist_ok=True)
        tensors, rest = _state(model, optimizer)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.rank == 0:
            write_json(
                out / ROLE_STATE_FILE,
                {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "trainer_version": __version__,
                    "role": self.role,
                    "world_size": world,
                    "sharded": fsdp.is_sharded(model),
                    "optimizer": rest,
                },
            )
            if extra is not None:
                extra(out)
        write_json(
            out / rank_file(self.rank),
            {
                "rng": rng.capture(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            },
        )
        writer = _Writer(out, self.rank)
        try:
            if asynchronous and dist.is_initialized():
                future = dcp.async_save(
                    tensors, storage_writer=writer, process_group=self._background_group()
                )
                self._pending = (out, future)
            else:
                dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as exc:
            raise CheckpointWriteError(
                f"checkpoint {out}: writing rank {self.rank}'s shard failed: {describe(exc)}"
            ) from exc

    def wait(self) -> None:
        """End the background write, if any; raise :class:`CheckpointWriteError` if it failed."""
        if self._pending is None:
            return
        out, future = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            raise CheckpointWriteError(
                f"checkpoint {out}: background write failed on rank {self.rank}: {describe(exc)}"
            ) from exc

    @property
    def pending(self) -> bool:
        """Whether a background write has been started and not yet waited for."""
        return self._pending is not None


def load_training_state(
    directory: str | Path,
    role: str,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
) -> None:
    """Restore what :meth:`CheckpointSaver.save` wrote, on any number of ranks (collective).

    Checks first, on every rank (so they fail together, before the collective
    load): the format version, the JSON files, and that every shard the index
    names is there and whole. Errors are :class:`CheckpointError` naming the file.
    """
    top = Path(directory)
    reject_old_layout(top)
    d = top / role
    if not d.is_dir():
        raise CheckpointError(f"{d}: missing (checkpoint {top} holds no {role} state)")
    info = read_json(d / ROLE_STATE_FILE)
    check_format(d / ROLE_STATE_FILE, info)
    verify_dcp_dir(d)
    own = d / rank_file(rank)
    per_rank = read_json(own if own.is_file() else d / rank_file(0))

    tensors, live = _state(model, optimizer)  # the layout this run wants; DCP reshards into it
    try:
        dcp.load(
            tensors,
            storage_reader=SafeFileSystemReader(d),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP: every rank's errors in one
        raise CheckpointError(f"{d}: cannot load the {role} state: {describe(exc)}") from None
    if optimizer is None:
        set_model_state_dict(model, tensors["model"], options=_options())
    else:
        optim_sd = tensors.get("optim", {})
        merge_non_tensors(optim_sd, conform(info.get("optimizer", {}), live))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict=optim_sd,
            options=_options(),
        )
    if scheduler is not None and per_rank.get("scheduler") is not None:
        scheduler.load_state_dict(per_rank["scheduler"])
    if own.is_file():
        try:
            rng.restore(per_rank["rng"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{own}: {exc}") from None
