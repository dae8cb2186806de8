"""Prompts for the trainer: synthetic tasks or users' Parquet/JSONL files.

Loading is strict and happens at start: a missing column or a value of the
wrong type is an error that names the file, the row and the column. Prompts
are tokenized once; those longer than ``data.max_prompt_length`` tokens are
dropped or truncated (keeping their end) and counted. Batches are left-padded
for generation. :class:`PromptLoader` owns the shuffling order and position,
which checkpoints save and restore.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from trainer.data.tasks import Example, get_task


class DataError(ValueError):
    """A data file or record that cannot be used; the message names file and column."""


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.parquet`` or ``.jsonl``/``.json`` file as dicts."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: data file does not exist")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as exc:  # pyarrow raises several unrelated types
            raise DataError(f"{p}: cannot read as Parquet: {exc}") from exc
    if suffix in (".jsonl", ".json"):
        rows = []
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{p}:{lineno}: not valid JSON: {exc.msg}") from exc
                if not isinstance(row, dict):
                    raise DataError(f"{p}:{lineno}: each line must be a JSON object")
                rows.append(row)
        return rows
    raise DataError(f"{p}: unsupported file type {suffix!r}; use .parquet or .jsonl")


def _check_prompt(value: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(
        f"{where}: expected a string or a list of {{'role', 'content'}} messages, got {type(value).__name__}"
    )


def load_examples(
    files: Sequence[str], prompt_key: str, ground_truth_key: str
) -> list[dict[str, Any]]:
    """Validated ``{"prompt", "ground_truth", "extra"}`` dicts from all ``files``.

    Extra columns are passed to the reward function as keyword arguments.
    """
    out: list[dict[str, Any]] = []
    for f in files:
        rows = read_records(f)
        if not rows:
            raise DataError(f"{f}: file has no rows")
        for col in (prompt_key, ground_truth_key):
            if col not in rows[0]:
                raise DataError(f"{f}: missing column {col!r} (columns: {sorted(rows[0])})")
        for i, row in enumerate(rows):
            if prompt_key not in row or ground_truth_key not in row:
                missing = prompt_key if prompt_key not in row else ground_truth_key
                raise DataError(f"{f}: row {i}: missing column {missing!r}")
            prompt = _check_prompt(row[prompt_key], f"{f}: row {i}: column {prompt_key!r}")
            gt = row[ground_truth_key]
            if isinstance(gt, (int, float)) and not isinstance(gt, bool):
                gt = str(gt)
            if not isinstance(gt, str):
                raise DataError(
                    f"{f}: row {i}: column {ground_truth_key!r}: expected a string, got {type(gt).__name__}"
                )
            extra = {k: v for k, v in row.items() if k not in (prompt_key, ground_truth_key)}
            out.append({"prompt": prompt, "ground_truth": gt, "extra": extra})
    return out


def examples_from_task(examples: Sequence[Example], task_name: str) -> list[dict[str, Any]]:
    """Synthetic examples in the same shape as :func:`load_examples` returns."""
    return [
        {
            "prompt": e.prompt,
            "ground_truth": e.ground_truth,
            "extra": {"data_source": task_name, **e.extra},
        }
        for e in examples
    ]


def encode_prompt(
    prompt: str | list[dict[str, str]], tokenizer, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of a plain-text prompt, or of chat messages through the chat template.

    ``tools`` (OpenAI function schemas, multi-turn only) go to the template,
    which shows them to the model the way the model was trained to see them.
    """
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat-message prompts need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template(
        prompt, tools=tools or None, tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


@dataclass
class PromptDataset:
    """Tokenized prompts with their ground truths and the length-filter counts."""

    input_ids: list[list[int]]
    ground_truths: list[str]
    extras: list[dict[str, Any]]
    num_dropped: int = 0
    num_truncated: int = 0
    pad_token_id: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, indices: Sequence[int]) -> tuple[TensorDict, list[str], list[dict[str, Any]]]:
        """Left-padded prompts for ``indices`` plus their ground truths and extras."""
        return (
            left_pad([self.input_ids[i] for i in indices], self.pad_token_id),
            [self.ground_truths[i] for i in indices],
            [self.extras[i] for i in indices],
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """Counts of prompts dropped or truncated for being too long."""
        return {
            f"{prefix}/prompts_dropped": float(self.num_dropped),
            f"{prefix}/prompts_truncated": float(self.num_truncated),
        }


def build_dataset(
    examples: Sequence[dict[str, Any]],
    tokenizer,
    max_prompt_length: int,
    overlong: str,
    source: str,
    tools: list[dict[str, Any]] | None = None,
) -> PromptDataset:
    """Tokenize ``examples``; drop or truncate (keep the end) prompts over the limit."""
    ids, gts, extras = [], [], []
    dropped = truncated = 0
    for ex in examples:
        toks = encode_prompt(ex["prompt"], tokenizer, tools)
        if len(toks) > max_prompt_length:
            if overlong == "drop":
                dropped += 1
                continue
            toks = toks[-max_prompt_length:]
            truncated += 1
        ids.append(toks)
        gts.append(ex["ground_truth"])
        extras.append(ex["extra"])
    if not ids:
        raise DataError(
            f"{source}: every prompt is longer than data.max_prompt_length={max_prompt_length} tokens "
            "and was dropped"
        )
    return PromptDataset(ids, gts, extras, dropped, truncated, int(tokenizer.pad_token_id))


def left_pad(seqs: Sequence[Sequence[int]], pad_token_id: int) -> TensorDict:
    """``input_ids``/``attention_mask`` (B, max len), padding on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(seqs)])


@dataclass
class PromptLoader:
    """Endless, seeded, epoch-wise shuffled batches of dataset indices.

    The state (epoch, position in the epoch) is all a checkpoint needs to
    continue with exactly the batches an uninterrupted run would have seen.
    """

    size: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise DataError("the training set is empty")
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        """The next ``batch_size`` indices, wrapping into the next epoch as needed."""
        out: list[int] = []
        while len(out) < self.batch_size:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def build_datasets(
    cfg, tokenizer, tools: list[dict[str, Any]] | None = None
) -> tuple[PromptDataset, PromptDataset]:
    """Train and validation datasets for ``cfg.data`` (files if given, else the synthetic task).

    ``tools``: the multi-turn tools' schemas, rendered into chat prompts.
    """
    d = cfg.data
    if d.train_files:
        train_ex = load_examples(d.train_files, d.prompt_key, d.ground_truth_key)
        val_ex = (
            load_examples(d.val_files, d.prompt_key, d.ground_truth_key)
            if d.val_files
            else train_ex[: d.num_val_examples]
        )
        sources = (", ".join(d.train_files), ", ".join(d.val_files) or "train files")
    else:
        task = get_task(d.task)
        tr, va = task.split(d.num_train_examples, d.num_val_examples, cfg.seed)
        train_ex, val_ex = examples_from_task(tr, task.name), examples_from_task(va, task.name)
        sources = (f"task {task.name}", f"task {task.name}")
    train = build_dataset(
        train_ex, tokenizer, d.max_prompt_length, d.overlong_prompts, sources[0], tools
    )
    val = build_dataset(
        val_ex, tokenizer, d.max_prompt_length, d.overlong_prompts, sources[1], tools
    )
    return train, val
