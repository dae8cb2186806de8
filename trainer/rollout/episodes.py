"""Multi-turn training on the driver's side: tools of a run, episode records, metrics, log.

The episode loop itself runs in the actor workers
(:mod:`trainer.rollout.episode_loop`); the driver (:class:`trainer.loop.ppo.PPOTrainer`)
only needs what is here: which tools a run uses, the per-example
``tools_kwargs`` sent with the prompts, the reward function's inputs (the
final answer plus the whole trajectory), the ``rollout/multi_turn/*`` and
``rollout/tools/*`` metrics, and the trajectory log written to the run
directory.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from tensordict import NonTensorStack, TensorDict

from trainer.config import Config

TRAJECTORY_FILE = "trajectories.jsonl"


def tool_specs(cfg: Config) -> list[str]:
    """``rollout.multi_turn.tools``, or the synthetic task's own tools when that is empty."""
    from trainer.data.tasks import get_task

    specs = list(cfg.rollout.multi_turn.tools)
    if not specs and not cfg.data.train_files:
        specs = list(get_task(cfg.data.task).tools)
    if not specs:
        raise ValueError(
            "rollout.multi_turn.enable=true but no tools: set rollout.multi_turn.tools=[...]"
        )
    return specs


def tool_response_length(cfg: Config) -> int:
    """``rollout.multi_turn.max_tool_response_length``, or the task's default when 0 (256 for files)."""
    from trainer.data.tasks import get_task

    if cfg.rollout.multi_turn.max_tool_response_length:
        return int(cfg.rollout.multi_turn.max_tool_response_length)
    return 256 if cfg.data.train_files else get_task(cfg.data.task).max_tool_response_length


def tool_schemas(cfg: Config) -> list[dict[str, Any]] | None:
    """The OpenAI schemas of the run's tools for the chat template (None without multi-turn)."""
    if not cfg.rollout.multi_turn.enable:
        return None
    from trainer.rollout.tools import load_tools

    return [t.schema() for t in load_tools(tool_specs(cfg))]


def attach_tools_kwargs(prompts: TensorDict, extras: list[dict[str, Any]]) -> TensorDict:
    """Add each example's ``tools_kwargs`` (JSON text per row) for the tools' ``create``."""
    rows = [json.dumps(e.get("tools_kwargs") or {}) for e in extras]
    prompts["tools_kwargs"] = NonTensorStack(*rows, batch_size=[len(rows)])
    return prompts


def episode_records(batch: TensorDict) -> list[dict[str, Any]]:
    """The per-episode records the workers returned (see ``Episode.record``)."""
    values = batch.get("episode")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [json.loads(v) for v in values]


def reward_inputs(
    records: list[dict[str, Any]], extras: list[dict[str, Any]]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Completions (final answers) and extras for the reward function.

    Each extra gains ``messages`` (assistant and tool messages in order),
    ``tool_rewards`` ({tool: reward}), ``tool_calls`` (status of each call)
    and ``num_turns``, so a reward can judge the whole trajectory.
    """
    texts = [r["answer"] for r in records]
    merged = [
        {
            **e,
            "messages": r["messages"],
            "tool_rewards": r["tool_rewards"],
            "tool_calls": r["calls"],
            "num_turns": r["turns"],
        }
        for r, e in zip(records, extras, strict=True)
    ]
    return texts, merged


def episode_metrics(records: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Means per episode under ``<prefix>/multi_turn/``; counts per tool under ``<prefix>/tools/``.

    ``tools/<name>/errors`` counts every failed call of that tool except
    timeouts (bad arguments, malformed arguments, exceptions, a failed create),
    ``tools/<name>/timeouts`` the timeouts. Calls that name no known tool are
    ``multi_turn/unknown_tool_calls``; unreadable ones ``multi_turn/malformed_calls``.
    """
    n = max(len(records), 1)
    calls = [c for r in records for c in r["calls"]]
    status = Counter(c["status"] for c in calls)
    m = {
        f"{prefix}/multi_turn/turns_mean": sum(r["turns"] for r in records) / n,
        f"{prefix}/multi_turn/tool_calls_mean": len(calls) / n,
        f"{prefix}/multi_turn/episodes_with_tool_call": sum(bool(r["calls"]) for r in records) / n,
        f"{prefix}/multi_turn/episodes_with_ok_call": sum(
            any(c["status"] == "ok" for c in r["calls"]) for r in records
        )
        / n,
        f"{prefix}/multi_turn/truncated": sum(r["truncated"] for r in records) / n,
        f"{prefix}/multi_turn/malformed_calls": float(
            sum(c["status"] == "malformed" and not c["tool"] for c in calls)
        ),
        f"{prefix}/multi_turn/unknown_tool_calls": float(status["unknown_tool"]),
        f"{prefix}/multi_turn/generated_tokens_mean": sum(r["generated_tokens"] for r in records)
        / n,
        f"{prefix}/multi_turn/masked_tokens_mean": sum(r["masked_tokens"] for r in records) / n,
    }
    names = sorted({name for r in records for name in r["tool_rewards"]})
    for name in names:
        mine = [c for c in calls if c["tool"] == name]
        m[f"{prefix}/tools/{name}/calls"] = float(len(mine))
        m[f"{prefix}/tools/{name}/errors"] = float(
            sum(c["status"] not in ("ok", "timeout") for c in mine)
        )
        m[f"{prefix}/tools/{name}/timeouts"] = float(sum(c["status"] == "timeout" for c in mine))
        m[f"{prefix}/tools/{name}/reward_mean"] = sum(r["tool_rewards"][name] for r in records) / n
    return {k: (v if math.isfinite(v) else 0.0) for k, v in m.items()}


class TrajectoryLog:
    """Appends a few decoded episodes per call to ``<run_dir>/trajectories.jsonl``."""

    def __init__(self, run_dir: str | Path, per_call: int) -> None:
        self.path = Path(run_dir) / TRAJECTORY_FILE
        self.per_call = per_call

    def write(
        self, step: int, split: str, records: list[dict[str, Any]], scores: list[float]
    ) -> None:
        """The first ``per_call`` episodes of a batch with their reward (no-op when 0)."""
        if self.per_call <= 0:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            for r, s in list(zip(records, scores, strict=True))[: self.per_call]:
                fh.write(json.dumps({"step": step, "split": split, "reward": s, **r}) + "\n")
