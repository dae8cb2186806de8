"""Rollout engines: turn left-padded prompts into sampled responses.

The driver and workers only see :class:`RolloutEngine` and the factory
(:mod:`trainer.rollout.factory`); ``rollout.engine=hf`` picks the Hugging Face
``generate`` engine on the actor's own module; ``rollout.engine=vllm`` picks
:mod:`trainer.rollout.vllm` (vLLM on CPU or CUDA), imported only then. The
driver cannot tell them apart.
"""

from trainer.rollout.base import RolloutEngine, SamplingParams, finish_responses
from trainer.rollout.factory import build_engine, build_rollout

__all__ = ["RolloutEngine", "SamplingParams", "build_engine", "build_rollout", "finish_responses"]
