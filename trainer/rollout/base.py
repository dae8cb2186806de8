"""The rollout engine protocol and the tensor layout every engine returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from tensordict import TensorDict


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class RolloutEngine(Protocol):
    """What the actor worker needs from a generator.

    ``generate`` takes a TensorDict with left-padded ``input_ids`` and
    ``attention_mask`` (B, P) and returns the layout of :func:`finish_responses`.
    ``sync_weights`` is called after every actor update so the engine samples
    from the new policy (a no-op when the engine shares the training module).
    """

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict: ...

    def sync_weights(self) -> None: ...


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token: the count of attended tokens before it.

    Left padding then does not shift positions, and neither do the holes a
    multi-turn episode leaves between turns.
    """
    return (attention_mask.cumsum(dim=1) - 1).clamp_min(0)


def finish_responses(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generated: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
) -> TensorDict:
    """Build the batch layout shared by all engines from raw generated tokens.

    ``generated`` (B, <=R) holds the new tokens only. The response is cut after
    its first EOS (kept, so the policy learns to stop), padded to exactly
    ``max_new_tokens`` with ``pad_token_id``, and described by:

    - ``prompts`` (B, P), ``responses`` (B, R)
    - ``input_ids`` = prompts ++ responses, ``attention_mask``, ``position_ids``
      (count of attended tokens before each position, so left padding does not
      shift positions)
    - ``response_mask`` (B, R): 1 on generated tokens up to and including EOS.
    """
    b = prompt_ids.shape[0]
    resp = torch.full(
        (b, max_new_tokens), pad_token_id, dtype=prompt_ids.dtype, device=prompt_ids.device
    )
    n = min(generated.shape[1], max_new_tokens)
    resp[:, :n] = generated[:, :n].to(prompt_ids.device)
    is_eos = resp == eos_token_id
    # Positions strictly after the first EOS are not part of the response.
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    if n < max_new_tokens:
        response_mask[:, n:] = 0
    resp = torch.where(response_mask.bool(), resp, torch.full_like(resp, pad_token_id))
    attention_mask = torch.cat([prompt_mask.long(), response_mask], dim=1)
    position_ids = positions_from_mask(attention_mask)
    return TensorDict(
        {
            "prompts": prompt_ids,
            "responses": resp,
            "input_ids": torch.cat([prompt_ids, resp], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
        },
        batch_size=[b],
    )
