"""Where each rank's rows of a call come from when the batch already lives in shards.

Pure logic, no Ray. A batch that stays with the workers
(:mod:`trainer.controller.resident`) is a list of shards, one per rank of the
call that made it; its real rows are the first ``real`` rows of the shards
taken in order (the rest are the padding that made the shards equal). A call
on a group of ``world`` ranks wants the rows a ``DP_SPLIT`` of the plain batch
would give: the real rows, padded to a multiple of ``divisor`` by repeating
rows ``0, 1, ...`` (as :func:`trainer.data.batch.pad_to_divisor` does), cut
into ``world`` equal parts. :func:`plan_rows` says, for every rank, which
slices of which shards make its part, so each rank assembles its rows from
the shards without the batch passing through the driver.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Piece", "plan_rows", "real_rows_per_shard"]


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of shard ``shard``; ``pad``: they are padding in the rank's part."""

    shard: int
    start: int
    stop: int
    pad: bool = False

    @property
    def rows(self) -> int:
        return self.stop - self.start


def real_rows_per_shard(shard_rows: Sequence[int], real: int) -> list[int]:
    """How many of each shard's rows are real (the first ``real`` rows, shards in order)."""
    if real < 1 or real > sum(shard_rows):
        raise ValueError(
            f"real rows must be in [1, {sum(shard_rows)}] for shards of {list(shard_rows)} rows, "
            f"got {real}"
        )
    out, left = [], real
    for rows in shard_rows:
        if rows < 0:
            raise ValueError(f"shard rows must be >= 0, got {list(shard_rows)}")
        out.append(min(rows, left))
        left -= out[-1]
    return out


def plan_rows(
    shard_rows: Sequence[int], real: int, world: int, divisor: int | None = None
) -> list[tuple[Piece, ...]]:
    """Each of ``world`` ranks' rows as pieces of the shards (see the module docstring).

    ``divisor`` (default ``world``) is what the real rows are padded to a
    multiple of; the result is padded to a multiple of ``world`` as well, so
    every rank gets the same number of rows. Consecutive rows of one shard
    make one piece.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    divisor = world if divisor is None else divisor
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    real_per_shard = real_rows_per_shard(shard_rows, real)
    starts = list(itertools.accumulate(real_per_shard, initial=0))
    step = math.lcm(divisor, world)
    per_rank = (real + (-real) % step) // world

    def sources(first: int, stop: int) -> Iterator[tuple[int, int, bool]]:
        """Runs of consecutive real rows (start, stop, pad) that target rows first:stop copy."""
        row = first
        while row < stop:
            if row < real:
                end = min(stop, real)
                yield row, end, False
            else:
                k = (row - real) % real
                end = row + min(stop - row, real - k)
                yield k, k + end - row, True
            row = end

    plans: list[tuple[Piece, ...]] = []
    for rank in range(world):
        pieces = []
        for start, stop, pad in sources(rank * per_rank, (rank + 1) * per_rank):
            shard = bisect.bisect_right(starts, start) - 1
            while start < stop:  # split the run where shards end
                while real_per_shard[shard] == 0:  # empty shards share their start with the next
                    shard += 1
                end = min(stop, starts[shard + 1])
                pieces.append(Piece(shard, start - starts[shard], end - starts[shard], pad))
                start, shard = end, shard + 1
        plans.append(tuple(pieces))
    return plans
