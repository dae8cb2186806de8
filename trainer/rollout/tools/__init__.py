"""Tools for multi-turn rollouts: the interface, loading, call parsers and the executor.

``rollout.multi_turn.tools=[pkg.mod:MyTool, /path/tools.py:Other]`` names
:class:`Tool` subclasses; :func:`load_tools` builds them, :func:`select_parser`
picks how calls are written for the tokenizer, and :class:`ToolExecutor`
runs them concurrently with a timeout. The episode loop that uses all of
this is :mod:`trainer.rollout.episode_loop`.
"""

from trainer.rollout.tools.base import Tool, ToolArgumentError, check_arguments
from trainer.rollout.tools.executor import STATUSES, CallOutcome, ToolExecutor
from trainer.rollout.tools.loading import load_tool, load_tools
from trainer.rollout.tools.parsers import (
    CompactParser,
    HermesParser,
    ParsedTurn,
    ToolCall,
    ToolCallParser,
    resolve_format,
    select_parser,
)

__all__ = [
    "STATUSES",
    "CallOutcome",
    "CompactParser",
    "HermesParser",
    "ParsedTurn",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolCallParser",
    "ToolExecutor",
    "check_arguments",
    "load_tool",
    "load_tools",
    "resolve_format",
    "select_parser",
]
