"""Rollout with Hugging Face ``generate`` on the actor's own module."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from trainer.rollout.base import SamplingParams, finish_responses


class HFGenerateEngine:
    """Samples with ``model.generate``; shares the training module, so no weight sync."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)

    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Sample up to ``params.max_new_tokens`` per prompt; see :func:`finish_responses`."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        was_training = self.model.training
        self.model.eval()
        try:
            greedy = params.temperature == 0
            kwargs = (
                dict(do_sample=False)
                if greedy
                else dict(
                    do_sample=True,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                )
            )
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                use_cache=True,
                **kwargs,
            )
        finally:
            self.model.train(was_training)
        return finish_responses(
            ids,
            mask,
            out[:, ids.shape[1] :],
            params.max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )

    def sync_weights(self) -> None:
        """Nothing to do: generation runs on the training module itself."""
