"""Build the rollout a worker samples with: the engine, and the episode loop over it.

The engines' modules are imported here, and only here, when selected: vLLM
is never imported by a run that uses ``rollout.engine=hf``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import Config
from trainer.rollout.base import RolloutEngine

__all__ = ["build_engine", "build_rollout"]


def build_engine(
    name: str, model: torch.nn.Module, tokenizer: Any, **options: Any
) -> RolloutEngine:
    """The engine for ``rollout.engine=name`` over the actor's ``model``.

    ``options`` are settings only engines holding their own copy of the model
    use (``model_path``, ``device``, ``kv_cache_memory``, ``seed``,
    ``max_model_len``: see :class:`~trainer.rollout.vllm.VLLMEngine`).
    """
    if name == "hf":
        from trainer.rollout.hf import HFGenerateEngine

        return HFGenerateEngine(model, tokenizer)
    if name == "vllm":
        from trainer.rollout.vllm import VLLMEngine, require_vllm

        require_vllm()
        return VLLMEngine(model, tokenizer, **options)
    raise ValueError(f"rollout.engine={name!r}: unknown engine; choose 'hf' or 'vllm'")


def build_rollout(cfg: Config, engine: RolloutEngine, tokenizer: Any) -> Any:
    """The worker's :class:`~trainer.rollout.episode_loop.MultiTurnRollout` over its ``engine``."""
    from trainer.rollout.episode_loop import MultiTurnRollout
    from trainer.rollout.episodes import tool_response_length, tool_specs
    from trainer.rollout.tools import ToolExecutor, load_tools, select_parser

    mt = cfg.rollout.multi_turn
    tools = load_tools(tool_specs(cfg))
    executor = ToolExecutor(tools, mt.tool_timeout, mt.max_concurrency)
    parser = select_parser(mt.format, tokenizer, tools)
    return MultiTurnRollout(
        engine, tokenizer, tools, parser, executor, mt.max_turns, tool_response_length(cfg)
    )
