"""The multi-turn episode loop: generate, parse tool calls, run tools, append results, repeat.

Used by the actor worker when ``rollout.multi_turn.enable=true``, over any
:class:`~trainer.rollout.base.RolloutEngine` (HF ``generate`` on CPU or CUDA,
vLLM): the loop only calls ``engine.generate`` on left-padded contexts, so
every engine gets multi-turn for free.

Episodes of a batch advance together, one *turn* at a time: every episode
still running is extended by one ``generate`` call over the whole batch, then
all their tool calls run concurrently (:class:`~trainer.rollout.tools.ToolExecutor`).
An episode stops at a turn without a tool call, after
``rollout.multi_turn.max_turns`` turns, or when its response budget
(``max_new_tokens``, counted over all turns, tool results included) is spent.

Layout returned (that of :func:`~trainer.rollout.base.finish_responses`, so
log-probs, values and losses need no change): ``responses`` (B, R) holds the
model's turns *and* the tool-result/template tokens between them, in order;
``attention_mask`` is 1 on all of them, so positions run on across turns;
``response_mask`` is 1 only on tokens the model generated, so the policy
loss, KL and entropy see exactly those. Extra keys: ``finished`` (the last
turn ended with EOS), ``num_turns``, and ``episode`` (one JSON record per
row: messages, tool outcomes, tool rewards, the final answer) for the reward
function, metrics and the trajectory log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from trainer.rollout.base import RolloutEngine, SamplingParams, positions_from_mask
from trainer.rollout.tools import CallOutcome, Tool, ToolCallParser, ToolExecutor

_HOLE = "\x00{}\x00"  # placeholder for a tool message's content inside a rendered frame


class ObservationRenderer:
    """Token ids that follow an assistant turn: its end-of-turn text, tool messages, next prompt.

    Rendered by the tokenizer's own chat template, so a real model sees tool
    results exactly as its template formats them. The text between the end
    of the assistant's content and the next generation prompt is the
    difference of two renderings (with and without the tool messages), minus
    the EOS the model emitted itself. Frames are cached per tuple of tool
    names; contents (cut to ``max_content_tokens``) are substituted into the
    frame text, which is tokenized whole (no special tokens added).
    """

    _ASSISTANT = "\x01assistant\x01"

    def __init__(
        self,
        tokenizer: Any,
        schemas: list[dict[str, Any]] | None = None,
        max_content_tokens: int = 256,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rollout.multi_turn.enable=true needs a tokenizer with a chat template: tool "
                "results are appended as 'tool' messages through it"
            )
        self.tok = tokenizer
        self.schemas = schemas or None
        self.max_content_tokens = max_content_tokens
        self._frames: dict[tuple[str, ...], str] = {}

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages,
            tools=self.schemas,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def frame(self, names: tuple[str, ...]) -> str:
        """Text after the assistant's content, with ``_HOLE.format(i)`` for tool message ``i``."""
        if names not in self._frames:
            base = [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": self._ASSISTANT},
            ]
            tools = [
                {"role": "tool", "name": n, "content": _HOLE.format(i)} for i, n in enumerate(names)
            ]
            head = self._render(base, False)
            full = self._render(base + tools, True)
            if not full.startswith(head):
                raise ValueError(
                    "the chat template renders earlier messages differently once tool messages "
                    "follow; multi-turn rollouts need a template that only appends"
                )
            end_of_turn = head[head.rindex(self._ASSISTANT) + len(self._ASSISTANT) :]
            eos = self.tok.eos_token or ""
            if eos and end_of_turn.startswith(eos):
                end_of_turn = end_of_turn[len(eos) :]  # the model generated it already
            self._frames[names] = end_of_turn + full[len(head) :]
        return self._frames[names]

    def clip(self, content: str) -> str:
        """``content`` cut to its first ``max_content_tokens`` tokens."""
        ids = self.tok(content, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_content_tokens:
            return content
        return self.tok.decode(ids[: self.max_content_tokens], skip_special_tokens=False)

    def render(self, outcomes: list[CallOutcome]) -> list[int]:
        """Token ids of the tool messages for ``outcomes`` and the next generation prompt."""
        text = self.frame(tuple(o.tool or "" for o in outcomes))
        for i, o in enumerate(outcomes):
            text = text.replace(_HOLE.format(i), self.clip(o.observation))
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


@dataclass
class Episode:
    """One conversation's progress: tokens so far, their loss mask, and what happened."""

    prompt: list[int]
    tools_kwargs: dict[str, Any]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each response token (0 on tool and template tokens)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[CallOutcome] = field(default_factory=list)
    states: dict[str, Any] = field(default_factory=dict)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    answer: str = ""
    turns: int = 0
    done: bool = False
    finished: bool = False
    truncated: bool = False

    def record(self, prompt_text: str) -> dict[str, Any]:
        """What the driver gets: a JSON-able summary of the episode."""
        return {
            "prompt": prompt_text,
            "messages": self.messages,
            "answer": self.answer,
            "turns": self.turns,
            "finished": self.finished,
            "truncated": self.truncated,
            "calls": [{"tool": o.tool, "status": o.status} for o in self.outcomes],
            "tool_rewards": self.tool_rewards,
            "generated_tokens": sum(self.mask),
            "masked_tokens": len(self.mask) - sum(self.mask),
        }


def _left_pad(seqs: list[list[int]], pad: int, device: torch.device) -> TensorDict:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long, device=device)
        mask[i, width - len(s) :] = 1
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(seqs)])


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


def _tools_kwargs(prompts: TensorDict, n: int) -> list[dict[str, Any]]:
    if "tools_kwargs" not in prompts.keys():
        return [{} for _ in range(n)]
    values = prompts.get("tools_kwargs")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [json.loads(v) if isinstance(v, str) else dict(v or {}) for v in values]


class MultiTurnRollout:
    """Runs batches of tool-using episodes on a rollout engine; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        tools: list[Tool],
        parser: ToolCallParser,
        executor: ToolExecutor,
        max_turns: int,
        max_tool_response_length: int = 256,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={max_turns}: must be >= 1")
        self.engine = engine
        self.tok = tokenizer
        self.parser = parser
        self.executor = executor
        self.max_turns = max_turns
        self.renderer = ObservationRenderer(
            tokenizer, [t.schema() for t in tools], max_tool_response_length
        )
        self.eos = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id)
        self._engine_log_probs = False

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Play one episode per row of ``prompts``; ``params.max_new_tokens`` is the whole budget."""
        ids, pmask = prompts["input_ids"], prompts["attention_mask"]
        device, budget = ids.device, params.max_new_tokens
        kwargs = _tools_kwargs(prompts, ids.shape[0])
        episodes = [Episode(p, kw) for p, kw in zip(_unpadded(ids, pmask), kwargs, strict=True)]
        self._engine_log_probs = False
        self._start(episodes)
        for _ in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            calls = self._generate_turn(active, params, budget, device)
            self._run_tools(calls, budget)
        for e in episodes:  # out of turns with a call still unanswered
            e.done = True
        self._finish(episodes)
        return self._layout(prompts, episodes, budget)

    # ----------------------------------------------------------------- phases of a turn

    def _start(self, episodes: list[Episode]) -> None:
        async def create_all() -> list[dict[str, Any]]:
            return await asyncio.gather(
                *(self.executor.create_states(e.tools_kwargs) for e in episodes)
            )

        for e, states in zip(episodes, self.executor.run(create_all()), strict=True):
            e.states = states

    def _generate_turn(
        self, active: list[Episode], params: SamplingParams, budget: int, device: torch.device
    ) -> list[tuple[Episode, list]]:
        """One assistant turn for every active episode; returns the episodes' parsed calls."""
        rooms = [budget - len(e.response) for e in active]
        contexts = _left_pad([e.prompt + e.response for e in active], self.pad, device)
        out = self.engine.generate(contexts, dataclasses.replace(params, max_new_tokens=max(rooms)))
        turns = _unpadded(out["responses"], out["response_mask"])
        # The response mask is a prefix of each row: a turn's log-probs sit at its tokens' places.
        self._engine_log_probs = "rollout_log_probs" in out.keys()
        engine_lp = (
            out["rollout_log_probs"].cpu().tolist()
            if self._engine_log_probs
            else [[0.0] * room for room in rooms]
        )
        pending = []
        for e, room, tokens, lp in zip(active, rooms, turns, engine_lp, strict=True):
            tokens = tokens[:room]
            ended = bool(tokens) and tokens[-1] == self.eos
            e.response += tokens
            e.mask += [1] * len(tokens)
            e.log_probs += lp[: len(tokens)]
            e.turns += 1
            text = self.tok.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
            parsed = self.parser.parse(text)
            e.messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {"name": c.name, "arguments": c.arguments, "error": c.error}
                        for c in parsed.calls
                    ],
                }
            )
            e.answer = parsed.content if parsed.calls else text
            if not ended:
                e.done, e.truncated = True, True
            elif not parsed.calls or e.turns >= self.max_turns:
                e.done, e.finished = True, True
            else:
                pending.append((e, parsed.calls))
        return pending

    def _run_tools(self, pending: list[tuple[Episode, list]], budget: int) -> None:
        """Run every pending call of the batch at once; append the results as tool messages."""

        async def run_all() -> list[list[CallOutcome]]:
            return await asyncio.gather(
                *(
                    asyncio.gather(*(self.executor.call(c, e.states) for c in calls))
                    for e, calls in pending
                )
            )

        if not pending:
            return
        for (e, _), outcomes in zip(pending, self.executor.run(run_all()), strict=True):
            e.outcomes += outcomes
            for o in outcomes:
                e.messages.append(
                    {"role": "tool", "name": o.tool, "content": self.renderer.clip(o.observation)}
                )
            obs = self.renderer.render(list(outcomes))
            if len(e.response) + len(obs) >= budget:  # no room left to answer
                e.done, e.truncated = True, True
                continue
            e.response += obs
            e.mask += [0] * len(obs)
            e.log_probs += [0.0] * len(obs)

    def _finish(self, episodes: list[Episode]) -> None:
        async def finish_all() -> list[dict[str, float]]:
            return await asyncio.gather(*(self.executor.finish_states(e.states) for e in episodes))

        for e, rewards in zip(episodes, self.executor.run(finish_all()), strict=True):
            e.tool_rewards = rewards

    def _layout(self, prompts: TensorDict, episodes: list[Episode], budget: int) -> TensorDict:
        ids, pmask = prompts["input_ids"], prompts["attention_mask"]
        b, device = ids.shape[0], ids.device
        resp = torch.full((b, budget), self.pad, dtype=ids.dtype, device=device)
        gen_mask = torch.zeros((b, budget), dtype=torch.long, device=device)
        real = torch.zeros((b, budget), dtype=torch.long, device=device)
        log_probs = torch.zeros((b, budget), dtype=torch.float32, device=device)
        for i, e in enumerate(episodes):
            n = len(e.response)
            resp[i, :n] = torch.tensor(e.response, dtype=ids.dtype, device=device)
            gen_mask[i, :n] = torch.tensor(e.mask, dtype=torch.long, device=device)
            log_probs[i, :n] = torch.tensor(e.log_probs, dtype=torch.float32, device=device)
            real[i, :n] = 1
        attention_mask = torch.cat([pmask.long(), real], dim=1)
        prompt_texts = self.tok.batch_decode(_unpadded(ids, pmask), skip_special_tokens=False)
        records = [json.dumps(e.record(t)) for e, t in zip(episodes, prompt_texts, strict=True)]
        out = TensorDict(
            {
                "prompts": ids,
                "responses": resp,
                "input_ids": torch.cat([ids, resp], dim=1),
                "attention_mask": attention_mask,
                "position_ids": positions_from_mask(attention_mask),
                "response_mask": gen_mask,
                "finished": torch.tensor([e.finished for e in episodes], device=device),
                "num_turns": torch.tensor([e.turns for e in episodes], device=device),
                "episode": NonTensorStack(*records, batch_size=[b]),
            },
            batch_size=[b],
        )
        if self._engine_log_probs:
            out["rollout_log_probs"] = log_probs
        return out
