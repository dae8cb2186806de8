"""Rollout engines: turn left-padded prompts into sampled responses.

The driver and workers only see :class:`RolloutEngine` and :func:`build_engine`;
``rollout.engine=hf`` picks the Hugging Face ``generate`` engine on the actor's
own module; ``rollout.engine=vllm`` picks :mod:`trainer.rollout.vllm` (CUDA, the
``vllm`` package), imported only then. The driver cannot tell them apart.
"""

from trainer.rollout.base import RolloutEngine, SamplingParams, build_engine, finish_responses

__all__ = ["RolloutEngine", "SamplingParams", "build_engine", "finish_responses"]
