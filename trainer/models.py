"""The tiny default model and tokenizer, and the one loading path for any causal LM.

Nothing here downloads anything. The default model is a randomly initialised
Llama-architecture causal LM with a character-level tokenizer, both built
locally with the Hugging Face APIs and written with ``save_pretrained`` into a
cache directory keyed by a hash of their specification. Every model, tiny or
real, is then read back through ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``: ``model.path=/path/to/Qwen2.5-0.5B`` goes
through exactly the code the tests exercise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

#: The tiny tokenizer's alphabet: what the synthetic tasks use, and little more.
#: Every extra symbol is one more wrong token a random-init policy must learn
#: to avoid, so the alphabet is kept small; other characters map to ``<unk>``.
CHARSET = "0123456789+-*=~:,. \n"

#: Renders each chat message as ``<|role|>content`` + newline; the generation
#: prompt opens the assistant's turn. Role markers are special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the default tiny model; its hash names the cache directory.

    Two heads of dimension 32: vLLM's CPU attention runs head dimensions 32
    and up (not 16), and the parameter count does not depend on the split.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    seed: int = 0

    def key(self) -> str:
        """A short stable hash of the spec and the vocabulary."""
        payload = json.dumps({"spec": asdict(self), "vocab": _VOCAB}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


_VOCAB: list[str] = [PAD, BOS, EOS, UNK, *ROLE_TOKENS, *CHARSET]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over :data:`CHARSET` plus role markers.

    Adds BOS at the start of every encoded text (like Llama tokenizers do), pads
    on the left (generation needs the prompt flush against the response), and
    carries :data:`CHAT_TEMPLATE`.
    """
    vocab = {tok: i for i, tok in enumerate(_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    from tokenizers.processors import TemplateProcessing

    core.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(spec: TinySpec, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM sized by ``spec`` (seeded)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    return model


def default_cache_dir() -> Path:
    """``$TRAINER_CACHE`` if set, else ``~/.cache/trainer``."""
    root = os.environ.get("TRAINER_CACHE") or os.path.join(Path.home(), ".cache", "trainer")
    return Path(root)


def ensure_tiny_model(spec: TinySpec | None = None, cache_dir: str | Path | None = None) -> Path:
    """Build the tiny model and tokenizer once and return their directory.

    The directory is ``<cache>/tiny-llama-<hash>``. It is written under a temp
    name in the same parent and renamed into place, so concurrent callers (two
    Ray workers, two test processes) either see a complete model or build their
    own copy and lose the rename race harmlessly.
    """
    spec = spec or TinySpec()
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / f"tiny-llama-{spec.key()}"
    if (target / "config.json").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    quiet_transformers()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        tok = build_char_tokenizer()
        build_tiny_model(spec, tok).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path: str | None) -> str:
    """``None``/``""``/``"tiny"`` mean the built-in tiny model; anything else is passed on.

    A local path that does not exist is an error naming it (we never fall back
    to a hub download).
    """
    if path in (None, "", "tiny"):
        return str(ensure_tiny_model())
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model.path={path!r}: not a directory (expected a save_pretrained model directory)"
        )
    return path


def quiet_transformers() -> None:
    """Silence transformers' progress bars and load reports (workers log to the driver)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer for generation: left padding, a pad token guaranteed."""
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load any causal LM directory through the generic ``from_pretrained`` path."""
    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.config.use_cache = True
    return model
