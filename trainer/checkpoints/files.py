"""The files of a checkpoint: format version, JSON metadata, and reading DCP shards safely.

No process group, no model: what the workers (:mod:`trainer.workers.state`),
the driver (:mod:`trainer.checkpoints.store`) and the export (:mod:`trainer.checkpoints.export`)
share about the layout on disk, and every check that turns a damaged or foreign
checkpoint into a :class:`CheckpointError` naming the file and the problem.

Safety: nothing is unpickled with ``weights_only=False``. Tensors are read by
``torch.distributed.checkpoint`` (its shard reader uses ``torch.load(...,
weights_only=True)``); DCP's own ``.metadata`` file is a pickle, read here by an
unpickler that resolves only DCP's metadata classes, ``torch.Size``, dtypes and
paths (anything else is refused before it is called); and DCP's byte items
(arbitrary pickles) are never written, and refused on load by
:class:`SafeLoadPlanner`. Everything else (optimizer hyper-parameters,
scheduler, RNG, driver state) is JSON.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ROLE_STATE_FILE",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_format",
    "conform",
    "describe",
    "merge_non_tensors",
    "rank_file",
    "read_json",
    "read_tensors",
    "safe_read_metadata",
    "split_tensors",
    "verify_dcp_dir",
    "write_json",
]

#: Written into every ``format.json`` and role ``state.json``; bump on any layout change.
FORMAT = "trainer-checkpoint"
FORMAT_VERSION = 2
#: Per role: format version, world size, strategy, optimizer hyper-parameters (rank 0).
ROLE_STATE_FILE = "state.json"
_DCP_METADATA = ".metadata"
_OLD_LAYOUT = ("driver.pt", "actor_state.pt", "critic_state.pt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong."""


def rank_file(rank: int) -> str:
    """A rank's own file in a role directory: its RNG states and scheduler."""
    return f"rank_{rank}.json"


# ----------------------------------------------------------------- JSON


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON (no NaN tokens: a non-finite float is an error naming ``path``)."""
    try:
        text = json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be written as JSON: {exc}") from None
    path.write_text(text)


def read_json(path: Path) -> Any:
    """Read a JSON file of a checkpoint; missing or malformed is a :class:`CheckpointError`."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted (not valid JSON: {exc})") from None


def check_format(path: Path, info: Mapping[str, Any]) -> None:
    """Raise unless ``info`` (read from ``path``) is this trainer's format and version."""
    if info.get("format") != FORMAT or not isinstance(info.get("version"), int):
        raise CheckpointError(f"{path}: not a trainer checkpoint file (no format/version)")
    if info["version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {info['version']}, this trainer reads version "
            f"{FORMAT_VERSION}; load it with the trainer version that wrote it "
            f"({info.get('trainer_version', 'unknown')}) and export it, or start a new run"
        )


def reject_old_layout(directory: Path) -> None:
    """Name the older single-file layout (``driver.pt``, ``<role>_state.pt`` pickles) if present."""
    old = [name for name in _OLD_LAYOUT if (directory / name).exists()]
    if old:
        raise CheckpointError(
            f"{directory}: a checkpoint of the older layout (format version 1: "
            f"{', '.join(old)}, pickled with torch.save), which this trainer does not unpickle; "
            "resume it with the trainer version that wrote it, or start a new run"
        )


# ----------------------------------------------------------------- tensors vs the rest


def split_tensors(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (tensors, everything else), both keeping the nesting.

    The tensors go to DCP (sharded, reshardable); the rest (optimizer
    hyper-parameters, ints, strings) to JSON. A dict holding both is split
    in two; lists are leaves and must hold no tensors.
    """
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping):
            t, r = split_tensors(value)
            if t:
                tensors[key] = t
            if r:
                rest[key] = r
        else:
            rest[key] = value
    return tensors, rest


def merge_non_tensors(target: dict[str, Any], rest: Mapping[str, Any]) -> None:
    """Put what :func:`split_tensors` set aside back into ``target`` (in place)."""
    for key, value in rest.items():
        current = target.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            merge_non_tensors(current, value)
        else:
            target[key] = value


def conform(value: Any, template: Any) -> Any:
    """``value`` read back from JSON, with tuples where ``template`` (the live state) has them.

    JSON has no tuples: AdamW's ``betas`` comes back a list; conforming it to
    the optimizer's own state makes the restored state equal the saved one.
    """
    if isinstance(value, Mapping) and isinstance(template, Mapping):
        return {k: conform(v, template.get(k)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(template, (list, tuple)):
        if len(value) == len(template):
            items = [conform(v, t) for v, t in zip(value, template, strict=True)]
        else:
            items = value
        return tuple(items) if isinstance(template, tuple) else list(items)
    return value


# ----------------------------------------------------------------- DCP, read safely

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
}
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's ``.metadata`` consists of; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


def safe_read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, unpickled through an allowlist of DCP's classes."""
    path = directory / _DCP_METADATA
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the shards' index, written last by DCP)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any failure to parse is corruption
        raise CheckpointError(f"{path}: corrupted ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path}: corrupted (not a DCP metadata record)")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`safe_read_metadata` instead of a bare ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # per-rank metadata files: this trainer never writes them
            raise CheckpointError(f"{self.path}: unexpected per-rank DCP metadata request")
        metadata = safe_read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or _storage_meta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _storage_meta() -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


class SafeLoadPlanner(DefaultLoadPlanner):
    """The default planner, refusing DCP byte items (pickles) instead of unpickling them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; this trainer "
            "stores only tensors in DCP files and does not unpickle others"
        )


def verify_dcp_dir(directory: Path) -> Metadata:
    """Check a role directory's DCP files before any rank reads them, and return the metadata.

    Every shard file the metadata names must exist and be long enough for the
    byte ranges it indexes: a missing or truncated shard is named here, on
    every rank, rather than as a read error deep inside a collective load.
    """
    metadata = safe_read_metadata(directory)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or rel.startswith("."):
            raise CheckpointError(
                f"{directory / _DCP_METADATA}: corrupted (bad shard name {rel!r})"
            )
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(needed.items()):
        shard = directory / rel
        if not shard.is_file():
            raise CheckpointError(
                f"{shard}: missing (a shard that {directory / _DCP_METADATA} indexes; "
                "the checkpoint was copied or deleted partly)"
            )
        actual = shard.stat().st_size
        if actual < size:
            raise CheckpointError(f"{shard}: truncated ({actual} bytes, the index needs {size})")
    return metadata


def read_tensors(directory: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of a DCP directory, whole, in this process (no group).

    For the export and for tests: the full tensors are rebuilt from however
    many shards wrote them. Keys are returned without ``prefix``.
    """
    import torch.distributed.checkpoint as dcp

    metadata = verify_dcp_dir(directory)
    state: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not state:
        raise CheckpointError(f"{directory / _DCP_METADATA}: no tensors under {prefix!r}")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(directory),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's own type too
        raise CheckpointError(f"{directory}: shards unreadable ({describe(exc)})") from None
    return {k[len(prefix) :]: v for k, v in state.items()}


def describe(exc: BaseException) -> str:
    """One line for an error, DCP's per-rank ``CheckpointException`` as each rank's own error."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {describe(failure[0])}" for rank, failure in sorted(exc.failures.items())
        )
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {text[0] if text else ''}"
