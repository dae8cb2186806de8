"""The tiny model and tokenizer: built locally, saved, loaded through the generic HF path."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.models import (
    EOS,
    TinySpec,
    build_char_tokenizer,
    ensure_tiny_model,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache"))


def test_char_tokenizer_round_trips_text_and_adds_bos():
    tok = build_char_tokenizer()
    ids = tok("7*3=")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + 4  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "7*3="
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == EOS


def test_char_tokenizer_pads_on_the_left_and_renders_chat():
    tok = build_char_tokenizer()
    enc = tok(["1=", "12345="], padding=True, return_tensors="pt")
    assert enc["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert enc["input_ids"][0, :4].tolist() == [tok.pad_token_id] * 4
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2+2"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>2+2\n<|assistant|>"


def test_tiny_model_builds_once_and_loads_through_auto_classes(tiny_dir):
    assert (tiny_dir / "config.json").is_file()
    before = os.path.getmtime(tiny_dir / "config.json")
    assert ensure_tiny_model(cache_dir=tiny_dir.parent) == tiny_dir  # cached, not rebuilt
    assert os.path.getmtime(tiny_dir / "config.json") == before
    assert not [p for p in tiny_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params * 4 < 2 * 2**20  # under 2 MB of float32 weights
    assert model.config.vocab_size == len(tok)
    assert tok.decode(tok("5*2=")["input_ids"], skip_special_tokens=True) == "5*2="


def test_same_spec_gives_same_weights_and_other_spec_another_dir(tmp_path, tiny_dir):
    again = ensure_tiny_model(cache_dir=tmp_path)
    a = load_causal_lm(str(tiny_dir)).state_dict()
    b = load_causal_lm(str(again)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = ensure_tiny_model(TinySpec(seed=1), cache_dir=tmp_path)
    assert other != again


def test_loaded_model_generates_and_tokenizer_is_left_padded(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    model = load_causal_lm(str(tiny_dir))
    enc = tok(["1*2=", "3*4="], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 3
    assert torch.equal(out[:, :prompt_len], enc["input_ids"])  # the prompt is kept
    assert tok.padding_side == "left"


def test_resolve_model_path_rejects_a_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="model.path=.*no-such-model"):
        resolve_model_path(str(missing))
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
