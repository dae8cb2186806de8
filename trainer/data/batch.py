"""TensorDict helpers for what one RL step needs.

Batches are plain :class:`tensordict.TensorDict` objects with one batch
dimension: tensors per sample, ``NonTensorStack`` for per-sample strings and
ragged lists, ``NonTensorData`` for batch-wide values. These helpers add only
what TensorDict does not give directly (building from per-sample dicts, exact
n-way splitting, padding by repeating real rows, conflict-checked union, an
explicit metrics merge); there is deliberately no batch class of our own.

Invariants every helper keeps:

* batch sizes are Python ``int`` (``TensorDict`` happily stores ``numpy.int64``
  when given one, e.g. ``batch_size=[mask.sum()]``, which later breaks JSON,
  ``isinstance(n, int)`` checks and Ray's metadata);
* ``pad_to_divisor`` always pads: there is no flag that could turn it off.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

__all__ = [
    "batch_len",
    "chunk",
    "concat",
    "device_of",
    "from_samples",
    "group_ids_for",
    "merge_metrics",
    "pad_to_divisor",
    "repeat_interleave",
    "select",
    "union",
    "unpad",
]


def _as_int(value: Any, name: str) -> int:
    """Return ``value`` as a Python int, or raise naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def _normalized(td: TensorDictBase) -> TensorDictBase:
    """Return ``td`` with its batch size made of Python ints (in place, cheap)."""
    size = td.batch_size
    if any(type(dim) is not int for dim in size):
        # The setter ignores a size that compares equal, so go through [] first.
        td.batch_size = torch.Size([])
        td.batch_size = torch.Size([operator.index(dim) for dim in size])
    return td


def _check_batched(td: Any, name: str = "batch") -> None:
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{name} must be a TensorDict, got {type(td).__name__}")
    if td.batch_dims != 1:
        raise ValueError(
            f"{name} must have exactly one batch dimension, got batch_size={list(td.batch_size)}"
        )


def device_of(td: TensorDictBase) -> torch.device:
    """The device of ``td``'s tensors: its own ``device``, else its first tensor's, else CPU.

    Index and padding tensors built for a batch go here, so they join its data
    on the same device (a TensorDict built from tensors without ``device=``
    reports ``None`` even when every tensor is on one card).
    """
    if td.device is not None:
        return td.device
    for value in td.values(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def batch_len(td: TensorDictBase) -> int:
    """Number of rows of a one-dimensional batch, as a Python int."""
    _check_batched(td)
    return operator.index(td.batch_size[0])


def _column(key: str, values: list[Any]) -> Any:
    """Turn one key's per-sample values into a tensor or a ``NonTensorStack``."""
    first = values[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        tensors = [torch.as_tensor(v) for v in values]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(
                f"samples disagree on the shape of tensor {key!r}: {sorted(shapes)}; "
                "pad them to one shape or pass them as lists (stored as a NonTensorStack)"
            )
        return torch.stack(tensors)
    if isinstance(first, (bool, int, float)) and all(
        isinstance(v, (bool, int, float)) for v in values
    ):
        return torch.tensor(values)
    return NonTensorStack(*values)


def from_samples(
    samples: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None
) -> TensorDict:
    """Build a batch from per-sample dicts.

    Tensors (and numpy arrays) of one shape are stacked; numbers become a 1-D
    tensor; anything else (strings, ragged lists, dicts) becomes a
    ``NonTensorStack``. ``meta`` holds batch-wide values, stored as
    ``NonTensorData``. Every sample must have the same keys.
    """
    if len(samples) == 0:
        raise ValueError("from_samples needs at least one sample, got an empty list")
    keys = list(samples[0].keys())
    for index, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise TypeError(f"sample {index} must be a dict, got {type(sample).__name__}")
        if set(sample.keys()) != set(keys):
            missing = sorted(set(keys) - set(sample.keys()))
            extra = sorted(set(sample.keys()) - set(keys))
            raise ValueError(
                f"sample {index} has different keys from sample 0: missing {missing}, extra {extra}"
            )
    size = len(samples)
    td = TensorDict({}, batch_size=[size])
    for key in keys:
        td.set(key, _column(key, [sample[key] for sample in samples]))
    for key, value in (meta or {}).items():
        if key in td.keys():
            raise ValueError(f"meta key {key!r} is also a per-sample key")
        td.set(key, NonTensorData(value, batch_size=[size]))
    return td


def pad_to_divisor(td: TensorDictBase, divisor: int) -> tuple[TensorDictBase, int]:
    """Pad ``td`` to a multiple of ``divisor`` rows by repeating its real rows.

    Returns ``(padded, pad_size)``; ``unpad(padded, pad_size)`` gives back the
    original rows. Padding rows are copies of rows ``0, 1, ...`` (cycling), so
    every padded row is a valid sample. Always pads when needed: the result's
    length is a multiple of ``divisor`` whatever the input.
    """
    divisor = _as_int(divisor, "divisor")
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    size = batch_len(td)
    if size == 0:
        raise ValueError("cannot pad an empty batch: there is no real row to repeat")
    pad_size = (-size) % divisor
    if pad_size == 0:
        return _normalized(td), 0
    index = torch.arange(pad_size, device=device_of(td)) % size
    return _normalized(torch.cat([td, td[index]], dim=0)), pad_size


def unpad(td: TensorDictBase, pad_size: int) -> TensorDictBase:
    """Drop the last ``pad_size`` rows added by :func:`pad_to_divisor`."""
    pad_size = _as_int(pad_size, "pad_size")
    size = batch_len(td)
    if not 0 <= pad_size <= size:
        raise ValueError(
            f"pad_size must be in [0, {size}] for a batch of {size} rows, got {pad_size}"
        )
    if pad_size == 0:
        return _normalized(td)
    return _normalized(td[: size - pad_size])


def chunk(td: TensorDictBase, n: int) -> list[TensorDictBase]:
    """Split ``td`` into exactly ``n`` consecutive parts (views).

    Sizes differ by at most one, the first parts taking the extra rows. Unlike
    ``torch.chunk``, this never returns fewer than ``n`` parts.
    """
    n = _as_int(n, "n")
    size = batch_len(td)
    if not 1 <= n <= size:
        raise ValueError(f"cannot chunk a batch of {size} rows into {n} non-empty parts")
    base, extra = divmod(size, n)
    sizes = [base + 1 if i < extra else base for i in range(n)]
    return [_normalized(part) for part in td.split(sizes, dim=0)]


def concat(tds: Sequence[TensorDictBase]) -> TensorDictBase:
    """Concatenate batches along the batch dimension; all must have the same keys."""
    if len(tds) == 0:
        raise ValueError("concat needs at least one TensorDict, got none")
    first_keys = set(tds[0].keys())
    for index, td in enumerate(tds):
        _check_batched(td, f"tds[{index}]")
        keys = set(td.keys())
        if keys != first_keys:
            raise ValueError(
                f"tds[{index}] has different keys from tds[0]: "
                f"missing {sorted(map(str, first_keys - keys))}, extra {sorted(map(str, keys - first_keys))}"
            )
    if len(tds) == 1:
        return _normalized(tds[0])
    return _normalized(torch.cat(list(tds), dim=0))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if is_non_tensor(a) and is_non_tensor(b):
        return a.tolist() == b.tolist()
    return False


def union(a: TensorDictBase, b: TensorDictBase) -> TensorDictBase:
    """Return a new batch with the keys of ``a`` and ``b``.

    Keys present in both must hold equal values; otherwise the error names
    them. Batch sizes must match.
    """
    _check_batched(a, "a")
    _check_batched(b, "b")
    if a.batch_size != b.batch_size:
        raise ValueError(
            f"union needs equal batch sizes, got {list(a.batch_size)} and {list(b.batch_size)}"
        )
    out = a.copy()
    conflicts = []
    for key in b.keys():
        value = b.get(key)
        if key in a.keys():
            if not _same_value(a.get(key), value):
                conflicts.append(key)
            continue
        out.set(key, value)
    if conflicts:
        raise ValueError(
            f"union: keys {sorted(conflicts)} are in both batches with different values"
        )
    return _normalized(out)


def group_ids_for(
    num_prompts: int, n: int, offset: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Group id per sample after repeating each prompt ``n`` times in place."""
    return torch.arange(offset, offset + num_prompts, device=device).repeat_interleave(n)


def repeat_interleave(td: TensorDictBase, n: int) -> TensorDictBase:
    """Repeat each row ``n`` times in place order: rows ``a, b`` become ``a, a, b, b``.

    Used to draw ``n`` responses per prompt.
    """
    n = _as_int(n, "n")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    size = batch_len(td)
    if n == 1:
        return _normalized(td.clone(recurse=False))
    return _normalized(td[torch.arange(size, device=device_of(td)).repeat_interleave(n)])


def select(td: TensorDictBase, keys: Iterable[str]) -> TensorDictBase:
    """Return a batch with only ``keys`` (sharing storage); missing keys are an error."""
    keys = list(keys)
    missing = [key for key in keys if key not in td.keys()]
    if missing:
        raise KeyError(f"select: keys {missing} are not in the batch (it has {sorted(td.keys())})")
    return _normalized(td.select(*keys))


_REDUCTIONS = {
    "mean": lambda values: math.fsum(values) / len(values),
    "sum": math.fsum,
    "max": max,
    "min": min,
}


def _metric_values(worker: int, key: str, value: Any) -> list[float]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.numel() == 1:
            item = item.item()
        if isinstance(item, bool) or not isinstance(item, (Real, np.number)):
            raise TypeError(
                f"metric {key!r} of worker {worker} must be a number or a list of numbers, "
                f"got {type(item).__name__}"
            )
        out.append(float(item))
    if not out:
        raise ValueError(f"metric {key!r} of worker {worker} is an empty list")
    return out


def merge_metrics(
    per_worker: Sequence[Mapping[str, float | Sequence[float]]],
    reduce: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Merge per-worker metric dicts into one dict of floats.

    Every worker must report exactly the same keys; the error lists, per
    worker, which keys are missing or extra. A value is a number or a list of
    numbers (e.g. one per micro-batch); all numbers of one key over all
    workers are reduced with ``reduce[key]`` (``"mean"`` by default, or
    ``"sum"``, ``"max"``, ``"min"``).
    """
    if len(per_worker) == 0:
        raise ValueError("merge_metrics needs the metrics of at least one worker, got none")
    reduce = dict(reduce or {})
    all_keys = set().union(*(m.keys() for m in per_worker))
    problems = []
    for worker, metrics in enumerate(per_worker):
        missing = sorted(all_keys - metrics.keys())
        if missing:
            problems.append(f"worker {worker} lacks {missing}")
    if problems:
        raise ValueError("workers reported different metric keys: " + "; ".join(problems))
    unknown = sorted(set(reduce) - all_keys)
    if unknown:
        raise ValueError(f"reduce names keys no worker reported: {unknown}")
    merged = {}
    for key in sorted(all_keys):
        how = reduce.get(key, "mean")
        if how not in _REDUCTIONS:
            raise ValueError(f"reduce[{key!r}] must be one of {sorted(_REDUCTIONS)}, got {how!r}")
        values = [v for w, m in enumerate(per_worker) for v in _metric_values(w, key, m[key])]
        merged[key] = float(_REDUCTIONS[how](values))
    return merged
