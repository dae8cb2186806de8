"""Rollout engines: turn left-padded prompts into sampled responses.

The driver and workers only see :class:`RolloutEngine` and :func:`build_engine`;
``rollout.engine=hf`` picks the Hugging Face ``generate`` engine. A vLLM engine
would be one more module implementing the same protocol and one more branch in
:func:`build_engine`; nothing else would change.
"""

from trainer.rollout.base import RolloutEngine, SamplingParams, build_engine, finish_responses

__all__ = ["RolloutEngine", "SamplingParams", "build_engine", "finish_responses"]
