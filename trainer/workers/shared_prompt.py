"""Run each distinct prompt through the model once, for all the responses drawn from it.

GRPO and RLOO draw ``rollout.n`` responses per prompt, so a batch of B rows
holds only B / n distinct prompts. Scoring every row as one (B, P + R) sequence
computes each prompt n times. Instead: one forward over the distinct prompts
(with their key/value cache kept), the cache indexed out to every row, and a
second forward over the responses only, attending to it. Gradients flow back
through the indexed cache into the prompt pass, so log-probs and gradients are
those of the full pass up to float rounding (``tests/trainer/test_shared_prompt.py``),
for (B / n) * P + B * R tokens of work instead of B * (P + R).

Both passes run whether or not prompts repeat, so every rank makes the same
number of forwards (FSDP2 collectives stay matched); whether to share is a
configuration choice (``actor.share_prompt``), never a per-batch one.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["prompt_groups", "share_prompt_enabled", "shared_prompt_logits"]


def share_prompt_enabled(setting: str, responses_per_prompt: int) -> bool:
    """Resolve ``actor.share_prompt``: ``auto`` shares when prompts repeat (``rollout.n > 1``)."""
    value = str(setting).lower()  # OmegaConf turns a command-line true into "True"
    if value == "auto":
        return responses_per_prompt > 1
    if value in ("true", "false"):
        return value == "true"
    raise ValueError(f"actor.share_prompt={setting!r}: choose 'auto', 'true' or 'false'")


def prompt_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: the first row of each distinct prompt, and each row's prompt index.

    Two rows share a prompt when their prompt tokens and padding agree, wherever
    they sit in the batch (mini-batches are shuffled). ``prompt_ids[first][inverse]``
    equals ``prompt_ids``.
    """
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(inverse.shape[0], device=inverse.device)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    first = torch.full((groups,), inverse.shape[0], dtype=rows.dtype, device=rows.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def shared_prompt_logits(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """Logits (B, R, V) predicting each response token, from one pass per distinct prompt.

    Same contract as the full pass of :func:`trainer.workers.compute.response_logits`
    before temperature: position P - 1 + t predicts response token t.
    """
    r = batch["response_mask"].shape[1]
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    p = ids.shape[1] - r
    first, inverse = prompt_groups(ids[:, :p], mask[:, :p])
    prompt_out = model(
        input_ids=ids[first, :p],
        attention_mask=mask[first, :p],
        position_ids=pos[first, :p],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = prompt_out.past_key_values
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise TypeError(
            f"{type(model).__name__} returned no indexable key/value cache "
            f"({type(cache).__name__}); set actor.share_prompt=false for this model"
        )
    cache.batch_select_indices(inverse)  # autograd-tracked indexing: gradients sum per prompt
    response_out = model(
        input_ids=ids[:, p:],
        attention_mask=mask,
        position_ids=pos[:, p:],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([prompt_out.logits[inverse], response_out.logits[:, :-1]], dim=1)
