"""User data files and synthetic prompts: loading, validation, length filter, padding, order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.config import load_config
from trainer.data.prompts import (
    DataError,
    PromptLoader,
    build_dataset,
    build_datasets,
    encode_prompt,
    left_pad,
    load_examples,
    read_records,
)
from trainer.models import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_parquet_and_jsonl_read_the_same_rows(tmp_path):
    rows = [
        {"prompt": "1+1=", "ground_truth": "2", "level": 1},
        {"prompt": "2+2=", "ground_truth": "4", "level": 2},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    _jsonl(tmp_path / "d.jsonl", rows)
    assert read_records(tmp_path / "d.parquet") == rows == read_records(tmp_path / "d.jsonl")
    ex = load_examples([str(tmp_path / "d.parquet")], "prompt", "ground_truth")
    assert ex[1] == {"prompt": "2+2=", "ground_truth": "4", "extra": {"level": 2}}


def test_chat_messages_go_through_the_chat_template(tmp_path, tok):
    f = _jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "user", "content": "3*2="}], "ground_truth": "33"}],
    )
    (ex,) = load_examples([f], "prompt", "ground_truth")
    ids = encode_prompt(ex["prompt"], tok)
    assert tok.decode(ids, skip_special_tokens=True) == "3*2=\n"
    assert tok.decode(ids) == "<s><|user|>3*2=\n<|assistant|>"  # role markers are single tokens
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_missing_column_names_file_and_column(tmp_path):
    f = _jsonl(tmp_path / "bad.jsonl", [{"question": "1+1=", "ground_truth": "2"}])
    with pytest.raises(DataError, match=r"bad.jsonl: missing column 'prompt'"):
        load_examples([f], "prompt", "ground_truth")


def test_wrong_types_name_file_row_and_column(tmp_path):
    f = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": 5, "answer": "2"}])
    with pytest.raises(DataError, match=r"t.jsonl: row 1: column 'prompt'"):
        load_examples([f], "prompt", "answer")
    f2 = _jsonl(tmp_path / "u.jsonl", [{"prompt": "a", "answer": ["x"]}])
    with pytest.raises(DataError, match=r"u.jsonl: row 0: column 'answer': expected a string"):
        load_examples([f2], "prompt", "answer")
    (ok,) = load_examples(
        [_jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "answer": 7}])], "prompt", "answer"
    )
    assert ok["ground_truth"] == "7"  # numbers are accepted as their text


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(DataError, match="missing.parquet: data file does not exist"):
        read_records(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="x.csv: unsupported file type"):
        read_records(tmp_path / "x.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl:2: not valid JSON"):
        read_records(tmp_path / "broken.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="broken.parquet: cannot read as Parquet"):
        read_records(tmp_path / "broken.parquet")


def test_overlong_prompts_are_dropped_or_truncated_and_counted(tok):
    examples = [
        {"prompt": p, "ground_truth": "x", "extra": {}} for p in ["12", "123456789", "1234"]
    ]
    dropped = build_dataset(examples, tok, max_prompt_length=5, overlong="drop", source="s")
    assert len(dropped) == 2 and dropped.num_dropped == 1 and dropped.num_truncated == 0
    assert dropped.metrics("rollout") == {
        "rollout/prompts_dropped": 1.0,
        "rollout/prompts_truncated": 0.0,
    }
    cut = build_dataset(examples, tok, max_prompt_length=5, overlong="truncate", source="s")
    assert len(cut) == 3 and cut.num_truncated == 1
    assert tok.decode(cut.input_ids[1]) == "56789"  # keeps the end, next to the answer
    with pytest.raises(DataError, match="every prompt is longer than data.max_prompt_length=1"):
        build_dataset(examples, tok, max_prompt_length=1, overlong="drop", source="s")


def test_left_pad_puts_padding_first():
    td = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert td["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert td["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_loader_is_seeded_wraps_epochs_and_restores_position():
    a = PromptLoader(size=10, batch_size=4, seed=1)
    batches = [a.next_indices() for _ in range(5)]
    assert sorted(batches[0] + batches[1] + batches[2][:2]) == list(
        range(10)
    )  # one epoch, no repeats
    b = PromptLoader(size=10, batch_size=4, seed=1)
    b.next_indices()
    b.next_indices()
    state = b.state_dict()
    c = PromptLoader(size=10, batch_size=4, seed=1)
    c.load_state_dict(state)
    assert [c.next_indices() for _ in range(3)] == batches[2:]
    assert PromptLoader(size=10, batch_size=4, seed=2).next_indices() != batches[0]


def test_build_datasets_from_task_and_from_files(tmp_path, tok):
    train, val = build_datasets(load_config(["data.num_val_examples=8"]), tok)
    assert len(val) == 8 and len(train) == 2048
    prompts, gts, extras = train.batch([0, 1])
    assert prompts["input_ids"].dtype == torch.long and len(gts) == 2
    assert extras[0]["data_source"] == "repeat"
    f = _jsonl(tmp_path / "tr.jsonl", [{"prompt": "1+1=", "ground_truth": "2"}] * 3)
    v = _jsonl(tmp_path / "va.jsonl", [{"prompt": "2+2=", "ground_truth": "4"}])
    train, val = build_datasets(
        load_config([f"data.train_files=[{f}]", f"data.val_files=[{v}]"]), tok
    )
    assert len(train) == 3 and val.ground_truths == ["4"]
