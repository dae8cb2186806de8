"""Unit tests of trainer.data.batch: pure TensorDict helpers, no Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from trainer.data import batch as B


def _samples(n: int) -> list[dict]:
    return [
        {
            "ids": torch.tensor([i, i + 1, i + 2]),
            "reward": float(i) / 2,
            "prompt": f"p{i}",
            "tokens": list(range(i)),  # ragged
        }
        for i in range(n)
    ]


def _batch(n: int = 5) -> TensorDict:
    return B.from_samples(_samples(n), meta={"step": 7})


def test_from_samples_builds_tensors_stacks_and_meta():
    td = _batch(4)
    assert td.batch_size == torch.Size([4])
    assert torch.equal(td["ids"], torch.tensor([[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]))
    assert torch.equal(td["reward"], torch.tensor([0.0, 0.5, 1.0, 1.5]))
    assert isinstance(td.get("prompt"), NonTensorStack)
    assert td["prompt"] == ["p0", "p1", "p2", "p3"]
    assert td["tokens"] == [[], [0], [0, 1], [0, 1, 2]]
    assert isinstance(td.get("step"), NonTensorData)
    assert td["step"] == 7


def test_from_samples_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one sample"):
        B.from_samples([])
    with pytest.raises(ValueError, match=r"sample 1 has different keys.*missing \['b'\]"):
        B.from_samples([{"a": 1, "b": 2}, {"a": 3}])
    with pytest.raises(ValueError, match="shape of tensor 'x'"):
        B.from_samples([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])
    with pytest.raises(ValueError, match="meta key 'a'"):
        B.from_samples([{"a": 1}], meta={"a": 2})


def test_pad_to_divisor_pads_by_repeating_real_rows_and_unpad_restores():
    td = _batch(5)
    padded, pad = B.pad_to_divisor(td, 4)
    assert pad == 3
    assert padded.batch_size == torch.Size([8])
    # the padding rows are real rows 0, 1, 2 again
    assert torch.equal(padded["ids"][5:], td["ids"][:3])
    assert padded["prompt"][5:] == ["p0", "p1", "p2"]
    assert padded["step"] == 7
    back = B.unpad(padded, pad)
    assert torch.equal(back["ids"], td["ids"]) and back["prompt"] == td["prompt"]


def test_pad_cycles_when_padding_exceeds_the_batch():
    td = B.from_samples([{"x": 1}, {"x": 2}])
    padded, pad = B.pad_to_divisor(td, 7)
    assert pad == 5
    assert padded["x"].tolist() == [1, 2, 1, 2, 1, 2, 1]


@pytest.mark.parametrize("size,divisor", [(1, 1), (4, 2), (5, 2), (5, 8), (9, 3), (7, 4)])
def test_padding_always_pads_to_a_multiple(size, divisor):
    # Trap: a "padding" option that silently does nothing. There is no option;
    # the result is always a multiple of the divisor.
    td = B.from_samples([{"x": i} for i in range(size)])
    padded, pad = B.pad_to_divisor(td, divisor)
    assert B.batch_len(padded) % divisor == 0
    assert B.batch_len(padded) == size + pad and 0 <= pad < divisor
    assert B.unpad(padded, pad)["x"].tolist() == list(range(size))


def test_pad_rejects_bad_input():
    td = _batch(3)
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        B.pad_to_divisor(td, 0)
    with pytest.raises(TypeError, match="divisor must be an integer"):
        B.pad_to_divisor(td, 2.0)
    with pytest.raises(ValueError, match="empty batch"):
        B.pad_to_divisor(td[:0], 2)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 3\]"):
        B.unpad(td, 4)


def test_batch_sizes_stay_python_ints_after_numpy_mask_indexing():
    # Trap: batch_size=[mask.sum()] with a numpy mask stores numpy.int64 in the
    # TensorDict's batch size; every helper hands back Python ints.
    td = _batch(6)
    mask = np.array([True, False, True, True, False, True])
    kept = td[torch.from_numpy(mask)]
    raw = TensorDict({"ids": kept["ids"]}, batch_size=[mask.sum()])
    assert type(raw.batch_size[0]) is not int  # the trap is real in tensordict
    for out in (
        B.pad_to_divisor(raw, np.int64(3))[0],
        B.unpad(raw, np.int64(1)),
        B.concat([raw, raw]),
        B.repeat_interleave(raw, np.int64(2)),
        B.select(raw, ["ids"]),
        *B.chunk(raw, np.int64(2)),
    ):
        assert all(type(d) is int for d in out.batch_size), out.batch_size
    padded, pad = B.pad_to_divisor(raw, np.int64(3))
    assert type(pad) is int and type(B.batch_len(padded)) is int
    json.dumps({"size": B.batch_len(padded), "pad": pad})  # ints, not numpy


def test_chunk_returns_exactly_n_parts():
    td = B.from_samples([{"x": i} for i in range(5)])
    parts = B.chunk(td, 4)  # torch.chunk would give 3 parts here
    assert [B.batch_len(p) for p in parts] == [2, 1, 1, 1]
    assert B.concat(parts)["x"].tolist() == list(range(5))
    with pytest.raises(ValueError, match="5 rows into 6"):
        B.chunk(td, 6)


def test_concat_keeps_non_tensors_and_checks_keys():
    a, b = _batch(2), _batch(3)
    c = B.concat([a, b])
    assert c["prompt"] == ["p0", "p1", "p0", "p1", "p2"]
    assert c["tokens"][2:] == [[], [0], [0, 1]]
    with pytest.raises(ValueError, match=r"tds\[1\] has different keys.*missing \['prompt'\]"):
        B.concat([a, b.exclude("prompt")])
    with pytest.raises(ValueError, match="at least one"):
        B.concat([])


def test_union_merges_and_rejects_conflicts():
    a = B.from_samples([{"x": 1, "s": "a"}, {"x": 2, "s": "b"}])
    b = B.from_samples([{"x": 1, "y": 5.0}, {"x": 2, "y": 6.0}])
    u = B.union(a, b)
    assert sorted(u.keys()) == ["s", "x", "y"]
    assert u["y"].tolist() == [5.0, 6.0] and u["s"] == ["a", "b"]
    assert "y" not in a.keys()  # inputs untouched
    bad = B.from_samples([{"x": 1, "s": "a"}, {"x": 3, "s": "z"}])
    with pytest.raises(
        ValueError, match=r"keys \['s', 'x'\] are in both batches with different values"
    ):
        B.union(a, bad)
    with pytest.raises(ValueError, match="equal batch sizes"):
        B.union(a, a[:1])


def test_repeat_interleave_repeats_each_row_in_place():
    td = _batch(3)
    r = B.repeat_interleave(td, 2)
    assert r["prompt"] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert torch.equal(r["ids"], td["ids"].repeat_interleave(2, dim=0))
    assert r["tokens"][4] == [0, 1]
    assert r["step"] == 7
    with pytest.raises(ValueError, match="n must be >= 1"):
        B.repeat_interleave(td, 0)


def test_select_keeps_only_named_keys():
    td = _batch(2)
    assert sorted(B.select(td, ["ids", "prompt"]).keys()) == ["ids", "prompt"]
    with pytest.raises(KeyError, match=r"\['nope'\] are not in the batch"):
        B.select(td, ["ids", "nope"])


def test_merge_metrics_is_explicit():
    merged = B.merge_metrics(
        [{"loss": 1.0, "lr": 0.1, "tok": 10}, {"loss": [2.0, 3.0], "lr": 0.1, "tok": 30}],
        reduce={"tok": "sum"},
    )
    assert merged == {"loss": pytest.approx(2.0), "lr": pytest.approx(0.1), "tok": 40.0}
    assert all(type(v) is float for v in merged.values())
    assert B.merge_metrics([{"a": torch.tensor(3.0)}, {"a": np.float32(1.0)}]) == {"a": 2.0}


def test_merge_metrics_error_names_differing_keys_whatever_worker_comes_first():
    # Trap: a schema taken from the first worker silently drops keys only
    # later workers report. Here every difference is an error naming the keys.
    with pytest.raises(ValueError, match=r"worker 1 lacks \['b'\]"):
        B.merge_metrics([{"a": 1.0, "b": 2.0}, {"a": 1.0}])
    with pytest.raises(ValueError, match=r"worker 0 lacks \['b'\]"):
        B.merge_metrics([{"a": 1.0}, {"a": 1.0, "b": 2.0}])
    with pytest.raises(ValueError, match=r"worker 0 lacks \['c'\]; worker 1 lacks \['b'\]"):
        B.merge_metrics([{"a": 1.0, "b": 2.0}, {"a": 1.0, "c": 2.0}])


def test_merge_metrics_rejects_bad_values():
    with pytest.raises(TypeError, match="metric 'a' of worker 1 must be a number"):
        B.merge_metrics([{"a": 1.0}, {"a": "x"}])
    with pytest.raises(ValueError, match="must be one of"):
        B.merge_metrics([{"a": 1.0}], reduce={"a": "median"})
    with pytest.raises(ValueError, match="no worker reported"):
        B.merge_metrics([{"a": 1.0}], reduce={"b": "sum"})
    with pytest.raises(ValueError, match="empty list"):
        B.merge_metrics([{"a": []}])
