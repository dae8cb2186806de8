"""Batches that stay with the workers: the step's tensors live in Ray's object store, in shards.

A worker method whose dispatch spec says ``resident=True`` keeps its result
where it was made: each rank puts every column of the TensorDict it returns
into Ray's object store (:func:`keep`, one object per column) and sends the
driver only references. The driver's handle, :class:`Resident`, reads like
the TensorDict the call would have returned: ``batch["responses"]`` fetches
that one column (every shard's part, joined) the first time the driver's own
math needs it, ``batch["advantages"] = adv`` puts a column the driver made
(each shard's rows, once), ``batch.update(other)`` adds another resident
result's columns without moving them. Passed to a ``DP_SPLIT`` call, a
:class:`Resident` becomes one :class:`ShardPlan` per rank: the references of
the shards its rows are in and which rows (:mod:`trainer.controller.layout`),
which the rank turns back into its TensorDict (:func:`resolve`) straight from
the object store.

So each tensor crosses the driver at most once a step: a column the driver
reads comes once, a column it writes goes once, and everything else moves
between workers through the object store. What crosses is counted in the
open ledger (:mod:`trainer.controller.ledger`). The objects are freed when
the last handle referring to them is dropped (Ray's reference counting).
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.exceptions import ObjectLostError
from tensordict import TensorDict, TensorDictBase

from trainer.controller import ledger
from trainer.controller.errors import InputLostError
from trainer.controller.layout import Piece, plan_rows, real_rows_per_shard
from trainer.data import batch as batch_ops

__all__ = ["Column", "Resident", "ShardColumns", "ShardPlan", "keep", "resolve"]

_MISSING = object()


@dataclass(frozen=True)
class ShardColumns:
    """One rank's kept result: a reference per column, its rows, each column's tensor bytes."""

    refs: dict[str, Any]
    rows: int
    nbytes: dict[str, int]


@dataclass(frozen=True)
class ShardPlan:
    """What a rank is sent in place of its part of a resident batch.

    ``columns[key][shard]``: the reference of ``key``'s object in ``shard``
    (only the shards that ``pieces`` name). ``zero``: columns whose padding
    rows read 0 in the rank's part (rows that carry no loss in an update).
    """

    pieces: tuple[Piece, ...]
    columns: dict[str, dict[int, Any]]
    zero: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def keep(result: Any) -> Any:
    """In a worker: put a TensorDict result's columns in the object store; anything else as is."""
    if not isinstance(result, TensorDictBase):
        return result
    rows = batch_ops.batch_len(result)
    refs, nbytes = {}, {}
    for key in result.keys():
        column = result.select(key)
        refs[key] = ray.put(column)
        nbytes[key] = ledger.tensor_bytes(column)
    return ShardColumns(refs, rows, nbytes)


def resolve(plan: ShardPlan) -> TensorDict:
    """In a worker: this rank's rows of a resident batch, read from the object store."""
    keys = list(plan.columns)
    shards = sorted({p.shard for p in plan.pieces})
    fetched = iter(ray.get([plan.columns[k][s] for k in keys for s in shards]))
    columns = {k: {s: next(fetched) for s in shards} for k in keys}
    out = TensorDict({}, batch_size=[plan.rows])
    for key in keys:
        parts = [columns[key][p.shard][p.start : p.stop] for p in plan.pieces]
        out.update(batch_ops.concat(parts))
    if plan.zero:
        pad = torch.cat([torch.full((p.rows,), p.pad) for p in plan.pieces])
        for key in plan.zero:
            if key not in out.keys():
                raise KeyError(f"padding rows should zero column {key!r}, which the batch lacks")
            value = out.get(key).clone()
            value[pad] = 0
            out.set(key, value)
    return out


@dataclass
class Column:
    """One column of a resident batch: a reference per shard, its bytes, the driver's copy once read.

    ``refs[i]`` is ``None`` for a shard with no real rows of a column the
    driver put. Handles made from one another (:meth:`Resident.select`,
    :meth:`Resident.update`, ...) share their columns, so a column the driver
    read through one is not fetched again through another.
    """

    refs: list[Any]
    nbytes: int
    """Tensor bytes over the batch's real rows."""
    value: Any = field(default=None, repr=False)
    fetched: bool = False


@dataclass
class Resident:
    """The driver's handle on a batch whose columns live in the object store, in shards.

    ``shard_rows``: each shard's rows; the first ``real`` rows of the shards in
    order are the batch's. ``divisor`` and ``zero``: how a call pads the rows
    (see :meth:`padded`).
    """

    columns: dict[str, Column]
    shard_rows: tuple[int, ...]
    real: int
    divisor: int = 1
    zero: tuple[str, ...] = ()

    @classmethod
    def from_shards(cls, shards: Sequence[ShardColumns], real: int) -> Resident:
        """The batch that ranks' :func:`keep` made, of which the first ``real`` rows are real."""
        keys = list(shards[0].refs)
        for rank, shard in enumerate(shards):
            if list(shard.refs) != keys:
                raise ValueError(
                    f"rank {rank} kept columns {list(shard.refs)}, rank 0 kept {keys}: "
                    "a resident result needs the same columns from every rank"
                )
        rows = tuple(s.rows for s in shards)
        real_rows = real_rows_per_shard(rows, real)

        def real_bytes(key: str) -> int:
            parts = (
                s.nbytes[key] * r / max(s.rows, 1) for s, r in zip(shards, real_rows, strict=True)
            )
            return round(sum(parts))

        columns = {k: Column([s.refs[k] for s in shards], real_bytes(k)) for k in keys}
        return cls(columns, rows, real)

    # -- what the driver reads and writes --------------------------------------------------

    @property
    def batch_size(self) -> torch.Size:
        return torch.Size([self.real])

    def keys(self) -> list[str]:
        return list(self.columns)

    def __contains__(self, key: str) -> bool:
        return key in self.columns

    def __len__(self) -> int:
        return self.real

    def tensor_bytes(self) -> int:
        """Tensor bytes of the batch's real rows, all columns (what ``perf/batch_bytes`` reports)."""
        return sum(c.nbytes for c in self.columns.values())

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Column ``key`` on the driver, fetched from the shards the first time."""
        if key not in self.columns:
            if default is _MISSING:
                raise KeyError(f"the batch has no column {key!r} (columns: {self.keys()})")
            return default
        self._fetch([key])
        return self.columns[key].value

    __getitem__ = get

    def __setitem__(self, key: str, value: Any) -> None:
        """Put ``value`` (the batch's rows) into the shards as column ``key``: it crosses once."""
        rows = value.shape[0] if getattr(value, "shape", None) else len(value)
        if rows != self.real:
            raise ValueError(f"column {key!r} has {rows} rows; the batch has {self.real}")
        self._put(TensorDict({key: value}, batch_size=[self.real]))

    def update(self, other: Resident | TensorDictBase) -> Resident:
        """Add ``other``'s columns: moved nowhere when resident in the same shards, else put."""
        if isinstance(other, Resident):
            if (other.shard_rows, other.real) != (self.shard_rows, self.real):
                raise ValueError(
                    f"cannot join resident batches of different layouts: shards "
                    f"{list(self.shard_rows)} with {self.real} real rows and "
                    f"{list(other.shard_rows)} with {other.real}"
                )
            self.columns.update(other.columns)
        else:
            self._put(other)
        return self

    def select(self, *keys: str) -> Resident:
        """A handle on ``keys`` only (nothing moves)."""
        missing = [k for k in keys if k not in self.columns]
        if missing:
            raise KeyError(f"the batch has no columns {missing} (columns: {self.keys()})")
        return self._with([k for k in self.columns if k in keys])

    def exclude(self, *keys: str) -> Resident:
        """A handle without ``keys`` (nothing moves; absent keys are ignored)."""
        return self._with([k for k in self.columns if k not in keys])

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Column ``key`` on the driver (fetched), and the batch without it."""
        if key not in self.columns and default is not _MISSING:
            return default
        value = self.get(key)
        del self.columns[key]
        return value

    def to_tensordict(self, keys: Iterable[str] | None = None) -> TensorDict:
        """The batch (or ``keys`` of it) on the driver; each column fetched at most once."""
        wanted = self.keys() if keys is None else list(keys)
        self._fetch(wanted)
        return TensorDict({k: self.columns[k].value for k in wanted}, batch_size=[self.real])

    def padded(self, divisor: int, zero: Sequence[str] = ()) -> Resident:
        """The same columns, padded by calls to a multiple of ``divisor`` rows, ``zero`` columns 0 there.

        The resident form of :func:`trainer.loop.ppo.pad_for_update`: nothing moves now.
        """
        missing = [k for k in zero if k not in self.columns]
        if missing:
            raise KeyError(f"cannot zero columns {missing} on padding rows: the batch lacks them")
        out = self._with(self.keys())
        out.divisor, out.zero = divisor, tuple(zero)
        return out

    def _with(self, keys: list[str]) -> Resident:
        columns = {k: self.columns[k] for k in keys}
        return Resident(columns, self.shard_rows, self.real, self.divisor, self.zero)

    # -- what calls send ------------------------------------------------------------------

    def plans(self, world: int) -> list[ShardPlan]:
        """One :class:`ShardPlan` per rank of a ``world``-rank call."""
        per_rank = plan_rows(self.shard_rows, self.real, world, self.divisor)
        return [
            ShardPlan(
                pieces,
                {k: {p.shard: c.refs[p.shard] for p in pieces} for k, c in self.columns.items()},
                self.zero,
            )
            for pieces in per_rank
        ]

    # -- moves, counted in the open ledger -------------------------------------------------

    def _fetch(self, keys: list[str]) -> None:
        """Read ``keys`` not yet on the driver from the shards (one ``ray.get`` for all)."""
        keys = [k for k in keys if not self.columns[k].fetched]
        if not keys:
            return
        t0 = time.perf_counter()
        real = real_rows_per_shard(self.shard_rows, self.real)
        shards = [i for i, r in enumerate(real) if r]
        try:
            values = iter(ray.get([self.columns[k].refs[i] for k in keys for i in shards]))
        except ObjectLostError:
            # The process that made the batch died (a rollout worker, say): that death is
            # the failure, and the trainer reports it as it does for a rank's lost input.
            raise InputLostError(
                "driver", 0, f"read of {', '.join(keys)}", traceback.format_exc()
            ) from None
        received = 0
        for key in keys:
            column = batch_ops.concat([next(values)[: real[i]] for i in shards])
            received += ledger.tensor_bytes(column)
            self.columns[key].value, self.columns[key].fetched = column.get(key), True
        ledger.record_fetch(time.perf_counter() - t0, received)

    def _put(self, td: TensorDictBase) -> None:
        if batch_ops.batch_len(td) != self.real:
            raise ValueError(
                f"columns {list(td.keys())} have {batch_ops.batch_len(td)} rows; "
                f"the batch has {self.real}"
            )
        t0 = time.perf_counter()
        real = real_rows_per_shard(self.shard_rows, self.real)
        bounds = [0, *itertools.accumulate(real)]
        for key in td.keys():
            part = td.select(key)
            refs = [
                ray.put(part[bounds[i] : bounds[i + 1]].clone()) if r else None
                for i, r in enumerate(real)
            ]
            self.columns[key] = Column(refs, ledger.tensor_bytes(part), td.get(key), True)
        ledger.record_put(time.perf_counter() - t0, ledger.tensor_bytes(td))
