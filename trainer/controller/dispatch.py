"""Dispatch modes: how a call on a role group is split over ranks and collected.

Pure logic, no Ray calls: :func:`split_call` turns one driver call into
per-rank arguments, :func:`collect_results` turns per-rank results into the
driver's return value. The worker group (``group.py``) does the remote part.
A resident batch (:mod:`trainer.controller.resident`) is split into plans
that name the rows each rank reads from the object store, not into rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

from trainer.controller.modes import Dispatch, DispatchSpec, as_spec
from trainer.controller.resident import Resident, ShardColumns
from trainer.data import batch as batch_ops

__all__ = ["Dispatch", "DispatchSpec", "SplitCall", "as_spec", "collect_results", "split_call"]


@dataclass(frozen=True)
class SplitCall:
    """Per-rank arguments of one call. ``ranks`` lists the ranks that run it."""

    ranks: tuple[int, ...]
    args: tuple[tuple[Any, ...], ...]
    kwargs: tuple[dict[str, Any], ...]
    pad_size: int = 0
    real_rows: int = 0
    """DP_SPLIT: the batch's rows before padding (what a resident result's real rows are)."""


def _dp_split(world_size: int, args: tuple, kwargs: dict, method: str) -> SplitCall:
    named = [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]
    sizes = {
        name: len(value) if isinstance(value, Resident) else batch_ops.batch_len(value)
        for name, value in named
        if isinstance(value, (TensorDictBase, Resident))
    }
    if not sizes:
        raise TypeError(f"{method}: DP_SPLIT needs at least one TensorDict argument, got none")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{method}: DP_SPLIT TensorDict arguments differ in batch size: {sizes}")
    kinds = {isinstance(value, Resident) for name, value in named if name in sizes}
    if len(kinds) > 1:
        raise TypeError(
            f"{method}: DP_SPLIT got resident and driver-side batches together "
            f"({sorted(sizes)}); join them first (Resident.update)"
        )
    pad_size = 0

    def parts(value: Any) -> list[Any]:
        nonlocal pad_size
        if isinstance(value, Resident):
            plans = value.plans(world_size)
            pad_size = sum(p.rows for p in plans) - len(value)
            return plans
        if not isinstance(value, TensorDictBase):
            return [value] * world_size
        padded, pad_size = batch_ops.pad_to_divisor(value, world_size)
        # A view pickles its whole storage: copy each chunk so every rank is
        # sent its own rows only.
        return [part.clone() for part in batch_ops.chunk(padded, world_size)]

    arg_parts = [parts(a) for a in args]
    kwarg_parts = {k: parts(v) for k, v in kwargs.items()}
    return SplitCall(
        ranks=tuple(range(world_size)),
        args=tuple(tuple(p[r] for p in arg_parts) for r in range(world_size)),
        kwargs=tuple({k: p[r] for k, p in kwarg_parts.items()} for r in range(world_size)),
        pad_size=pad_size,
        real_rows=next(iter(sizes.values())),
    )


def _all_to_all(world_size: int, args: tuple, kwargs: dict, method: str) -> SplitCall:
    for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = (
                f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            )
            raise ValueError(
                f"{method}: ALL_TO_ALL needs {name} to be a list of {world_size} items "
                f"(one per rank), got {got}"
            )
    return SplitCall(
        ranks=tuple(range(world_size)),
        args=tuple(tuple(a[r] for a in args) for r in range(world_size)),
        kwargs=tuple({k: v[r] for k, v in kwargs.items()} for r in range(world_size)),
    )


def split_call(
    mode: Dispatch,
    world_size: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    method: str = "call",
) -> SplitCall:
    """Turn one driver call into per-rank arguments according to ``mode``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    args, kwargs = tuple(args), dict(kwargs)
    match mode:
        case Dispatch.ONE_TO_ALL:
            return SplitCall(tuple(range(world_size)), (args,) * world_size, (kwargs,) * world_size)
        case Dispatch.ALL_TO_ALL:
            return _all_to_all(world_size, args, kwargs, method)
        case Dispatch.DP_SPLIT:
            return _dp_split(world_size, args, kwargs, method)
        case Dispatch.RANK_ZERO:
            return SplitCall((0,), (args,), (kwargs,))
    raise TypeError(f"{method}: unknown dispatch mode {mode!r}")


def collect_results(
    mode: Dispatch, results: Sequence[Any], pad_size: int = 0, real_rows: int = 0
) -> Any:
    """Combine per-rank results (in rank order) into the driver's return value.

    Results that ranks kept in the object store (:func:`trainer.controller.resident.keep`)
    become one :class:`~trainer.controller.resident.Resident` of ``real_rows`` rows.
    """
    results = list(results)
    if results and all(isinstance(r, ShardColumns) for r in results):
        return Resident.from_shards(results, real_rows)
    match mode:
        case Dispatch.ONE_TO_ALL | Dispatch.ALL_TO_ALL:
            return results
        case Dispatch.RANK_ZERO:
            return results[0]
        case Dispatch.DP_SPLIT:
            if results and all(isinstance(r, TensorDictBase) for r in results):
                return batch_ops.unpad(batch_ops.concat(results), pad_size)
            return results
    raise TypeError(f"unknown dispatch mode {mode!r}")
