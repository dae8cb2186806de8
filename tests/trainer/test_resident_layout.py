"""Which shard rows make each rank's part of a resident batch: pure logic, no Ray.

The property: assembling every rank's pieces from the shards gives exactly
the rows a ``DP_SPLIT`` of the plain batch would give that rank (real rows,
padded by repeating rows 0, 1, ... to the divisor, cut into equal parts), and
marks as padding exactly the rows past the real ones. Checked over shard
layouts made by generation calls of 1-4 ranks and consuming calls of 1-4
ranks with divisors 1-3 times their size.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from trainer.controller.layout import Piece, plan_rows, real_rows_per_shard
from trainer.data import batch as batch_ops


def _shards(real: int, world: int) -> tuple[list[int], list[torch.Tensor]]:
    """Shards a ``world``-rank generation call makes of ``real`` rows: row ids, -1 for padding."""
    padded = batch_ops.pad_to_divisor(TensorDict({"id": torch.arange(real)}, [real]), world)[0]
    parts = [p["id"].clone() for p in batch_ops.chunk(padded, world)]
    for part, start in zip(parts, range(0, len(padded), len(parts[0])), strict=True):
        part[torch.arange(start, start + len(part)) >= real] = -1  # padding: never to be read
    return [len(p) for p in parts], parts


def _assemble(pieces: tuple[Piece, ...], shards: list[torch.Tensor]) -> tuple[list, list]:
    rows = torch.cat([shards[p.shard][p.start : p.stop] for p in pieces]).tolist()
    pads = [p.pad for p in pieces for _ in range(p.rows)]
    return rows, pads


@pytest.mark.parametrize("made_by", [1, 2, 3, 4])
def test_every_rank_reads_the_rows_a_plain_split_would_send_it(made_by):
    for real in range(1, 14):
        shard_rows, shards = _shards(real, made_by)
        for world in (1, 2, 3, 4):
            for divisor in (world, 2 * world, 3 * world, 1):
                plans = plan_rows(shard_rows, real, world, divisor)
                step = math.lcm(divisor, world)
                plain = batch_ops.pad_to_divisor(
                    TensorDict({"id": torch.arange(real)}, [real]), step
                )
                expected = batch_ops.chunk(plain[0], world)
                assert len(plans) == world
                for rank, (pieces, want) in enumerate(zip(plans, expected, strict=True)):
                    rows, pads = _assemble(pieces, shards)
                    where = (made_by, real, world, divisor, rank)
                    assert rows == want["id"].tolist(), where
                    start = rank * len(want)
                    assert pads == [start + i >= real for i in range(len(want))], where


def test_consecutive_rows_of_a_shard_are_one_piece():
    # 6 real rows in shards of 3 and 3, read by 2 ranks: one piece each, nothing padded.
    assert plan_rows([3, 3], 6, 2) == [(Piece(0, 0, 3),), (Piece(1, 0, 3),)]
    # 5 real rows (shard 1 padded by one) read by 1 rank padded to 4: rows 0-4, then 0-2 as padding.
    assert plan_rows([3, 3], 5, 1, 4) == [
        (Piece(0, 0, 3), Piece(1, 0, 2), Piece(0, 0, 3, pad=True)),
    ]


def test_real_rows_are_the_first_rows_of_the_shards_in_order():
    assert real_rows_per_shard([3, 3, 3], 7) == [3, 3, 1]
    assert real_rows_per_shard([2, 0, 2], 3) == [2, 0, 1]


def test_a_shard_with_no_real_rows_is_never_read():
    plans = plan_rows([2, 0, 2], 3, 3, 3)
    assert all(p.shard != 1 for pieces in plans for p in pieces)


@pytest.mark.parametrize(
    "args,message",
    [
        (([3, 3], 0, 2), r"real rows must be in \[1, 6\] for shards of \[3, 3\] rows, got 0"),
        (([3, 3], 7, 2), r"real rows must be in \[1, 6\] for shards of \[3, 3\] rows, got 7"),
        (([3, 3], 6, 0), r"world must be >= 1, got 0"),
        (([3, 3], 6, 2, 0), r"divisor must be >= 1, got 0"),
    ],
)
def test_bad_layouts_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        plan_rows(*args)
