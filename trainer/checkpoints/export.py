"""``python -m trainer.checkpoints.export CHECKPOINT OUT_DIR``: a checkpoint's policy as a Hugging Face model.

Reads the actor's sharded DCP state of ``CHECKPOINT`` (a ``step_N`` directory,
written by any number of ranks) in one process, puts it into the model that
``<checkpoint>/actor/hf/config.json`` describes, and writes ``OUT_DIR`` with
``save_pretrained`` (safetensors weights, ``config.json``, generation config)
plus the tokenizer: a directory that ``AutoModelForCausalLM.from_pretrained``
and vLLM load. The export holds the whole model (weights only, no optimizer
state) in host memory once; training never does.

``--role critic`` exports the value model's weights the same way (its config
is the actor's backbone with a one-output token head, rebuilt from the actor's
``hf`` directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoints.files import (
    ROLE_STATE_FILE,
    CheckpointError,
    check_format,
    read_json,
    read_tensors,
    reject_old_layout,
)

__all__ = ["HF_DIR", "export_checkpoint", "main", "save_hf_model", "write_hf_files"]

#: Inside the actor's role directory: config and tokenizer files, for the export.
HF_DIR = "hf"


def write_hf_files(role_dir: Path, model: torch.nn.Module, tokenizer: Any) -> None:
    """Write the model's config (and generation config) and the tokenizer into ``role_dir/hf``.

    Called on rank 0 by the actor at each save: small files that make the
    checkpoint self-contained for :func:`export_checkpoint`.
    """
    out = role_dir / HF_DIR
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, role: str = "actor") -> Path:
    """Write checkpoint ``role``'s model as a Hugging Face directory; return ``out_dir``.

    Raises :class:`CheckpointError` naming the file when the checkpoint is of
    another layout or version, incomplete, or corrupted.
    """
    from transformers import AutoConfig, AutoTokenizer

    from trainer.models import quiet_transformers

    quiet_transformers()
    ckpt = Path(checkpoint)
    reject_old_layout(ckpt)
    role_dir = ckpt / role
    if not role_dir.is_dir():
        raise CheckpointError(f"{role_dir}: missing (no {role} state in {ckpt})")
    check_format(role_dir / ROLE_STATE_FILE, read_json(role_dir / ROLE_STATE_FILE))
    hf = ckpt / "actor" / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{hf / 'config.json'}: missing (the actor writes it at each save)")
    state = read_tensors(role_dir, prefix="model.")
    tokenizer = (
        AutoTokenizer.from_pretrained(hf, local_files_only=True)
        if (hf / "tokenizer_config.json").is_file()
        else None
    )
    if role == "actor":
        config = AutoConfig.from_pretrained(hf, local_files_only=True)
    else:
        config = AutoConfig.from_pretrained(hf, num_labels=1, local_files_only=True)
    try:
        return save_hf_model(out_dir, config, state, tokenizer, causal_lm=role == "actor")
    except RuntimeError as exc:
        raise CheckpointError(
            f"{role_dir}: the saved tensors do not fit the model of {hf / 'config.json'}: "
            f"{str(exc).splitlines()[0]}"
        ) from None


def save_hf_model(
    out_dir: str | Path,
    config: Any,
    state: dict[str, torch.Tensor],
    tokenizer: Any | None,
    *,
    causal_lm: bool = True,
) -> Path:
    """Write ``state`` (full, plain HF names) as a ``save_pretrained`` directory of the plain class.

    The model is built on the meta device and the tensors assigned, so no
    second copy of the weights is made. Shared by the export and the actor's
    end-of-run :meth:`~trainer.workers.actor.ActorRolloutRefWorker.save_model`
    (whose FSDP2 class must not name the ``architectures`` vLLM reads).
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    factory = AutoModelForCausalLM if causal_lm else AutoModelForTokenClassification
    with torch.device("meta"):
        model = factory.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary frequencies) stay on the meta device: save_pretrained
    # does not write them and from_pretrained computes them, so no full CPU model is built.
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 2 with one line naming the file for a bad checkpoint."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.checkpoints.export",
        description="Write a checkpoint's model as a Hugging Face directory (safetensors, "
        "config, tokenizer) that from_pretrained and vLLM load.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory, e.g. runs/a/checkpoints/step_000010"
    )
    parser.add_argument("out_dir", help="where to write the model directory")
    parser.add_argument("--role", default="actor", choices=("actor", "critic"))
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.role)
    except CheckpointError as exc:
        print(f"trainer.checkpoints.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"trainer.checkpoints.export: wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
