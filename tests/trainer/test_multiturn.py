"""The multi-turn episode loop: layout, loss mask, positions, budget, failures, concurrency.

A scripted engine (the ``RolloutEngine`` protocol, returning the turns a
test wrote) drives the real loop, executor, parser and chat template, so
each test knows exactly which calls are made. The tiny Llama model then
checks what training sees: the gradient of the loss with respect to the
logits is exactly zero at tool-result and template positions, and logits
over a multi-turn batch equal those of each conversation run alone.
"""

from __future__ import annotations

import asyncio
import json
import string
import time
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack
from test_tools import Add as PlainAdd  # rootdir-relative import, as test_gpu_fsdp does
from test_tools import Boom, Hang
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.algorithms import ppo_math as algos
from trainer.data.prompts import left_pad
from trainer.loop.ppo import token_level_rewards
from trainer.models import CHAT_TEMPLATE, TinySpec, build_tiny_model
from trainer.rollout import SamplingParams, finish_responses
from trainer.rollout.episode_loop import MultiTurnRollout
from trainer.rollout.episodes import episode_metrics, episode_records, reward_inputs
from trainer.rollout.tools import Tool, ToolExecutor, select_parser
from trainer.workers.compute import response_logits, token_log_probs

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|tool|>"]
HERMES = ["<tool_call>", "</tool_call>"]


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer over printable ASCII, so Hermes JSON calls can be spelled."""
    vocab = {t: i for i, t in enumerate(SPECIALS + HERMES + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:] + HERMES,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


class ScriptedEngine:
    """Answers each context with the next turn of ``script(prompt, turn)`` (then EOS)."""

    def __init__(self, tokenizer: Any, script: Any) -> None:
        self.tok, self.script = tokenizer, script
        self.calls = 0

    def generate(self, prompts, params: SamplingParams):
        self.calls += 1
        rows = []
        for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True):
            text = self.tok.decode(ids[mask.bool()].tolist())
            prompt = text.split("<|user|>")[1].split("\n")[0]
            turn = text.count("<|assistant|>") - 1
            out = self.tok(self.script(prompt, turn), add_special_tokens=False)["input_ids"]
            rows.append(out + [self.tok.eos_token_id])
        width = max(len(r) for r in rows)
        gen = torch.full((len(rows), width), self.tok.pad_token_id, device=prompts.device)
        for i, r in enumerate(rows):
            gen[i, : len(r)] = torch.tensor(r)
        return finish_responses(
            prompts["input_ids"],
            prompts["attention_mask"],
            gen,
            params.max_new_tokens,
            self.tok.eos_token_id,
            self.tok.pad_token_id,
        )

    def sync_weights(self) -> None:
        pass


class Add(PlainAdd):
    """``add`` with per-episode state: counts calls; its reward is the episode's ``bonus``."""

    async def create(self, **kwargs):
        return {"calls": 0, "bonus": kwargs.get("bonus", 0.0)}

    async def execute(self, arguments, state):
        state["calls"] += 1
        return await super().execute(arguments, state)

    async def reward(self, state):
        return state["bonus"] if state["calls"] else 0.0


class Sleep(Tool):
    name = "sleep"

    async def execute(self, arguments, state):
        await asyncio.sleep(0.2)
        return "5"


def call(name: str, **args: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def prompts_for(tok, texts: list[str], tools_kwargs: list[dict] | None = None):
    ids = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
        )["input_ids"]
        for t in texts
    ]
    td = left_pad(ids, tok.pad_token_id)
    if tools_kwargs is not None:
        td["tools_kwargs"] = NonTensorStack(*[json.dumps(k) for k in tools_kwargs])
    return td


def rollout(tok, script, tools, *, max_turns=4, timeout=5.0, concurrency=64):
    executor = ToolExecutor(tools, timeout, concurrency)
    engine = ScriptedEngine(tok, script)
    parser = select_parser("auto", tok, tools)
    return MultiTurnRollout(engine, tok, tools, parser, executor, max_turns), executor


@pytest.fixture(scope="module")
def tok():
    return ascii_tokenizer()


# ----------------------------------------------------------------- the layout


def test_two_turn_episode_layout_and_mask(tok):
    def script(prompt, turn):
        return ["ok " + call("add", a=2, b=3), "5"][turn]

    mt, ex = rollout(tok, script, [Add()])
    with ex:
        out = mt.generate(prompts_for(tok, ["2+3"], [{"add": {"bonus": 0.5}}]), SamplingParams(96))
    resp, mask = out["responses"][0], out["response_mask"][0]
    real = out["attention_mask"][0, out["prompts"].shape[1] :]
    n = int(real.sum())
    text = tok.decode(resp[:n].tolist())
    # The model's turn, the template's end of turn, the tool message, the next prompt, the answer.
    assert text == "ok " + call("add", a=2, b=3) + "</s>\n<|tool|>5\n<|assistant|>5</s>"
    generated = tok.decode(resp[mask.bool()].tolist())
    assert generated == "ok " + call("add", a=2, b=3) + "</s>5</s>"
    masked = tok.decode(resp[:n][~mask[:n].bool()].tolist())
    assert masked == "\n<|tool|>5\n<|assistant|>"
    assert out["finished"].tolist() == [True] and out["num_turns"].tolist() == [2]
    # Positions continue through the tool tokens: no gap, no restart.
    pos = out["position_ids"][0][out["attention_mask"][0].bool()]
    assert pos.tolist() == list(range(len(pos)))
    (rec,) = episode_records(out)
    assert rec["answer"] == "5" and rec["tool_rewards"] == {"add": 0.5}
    assert [m["role"] for m in rec["messages"]] == ["assistant", "tool", "assistant"]
    assert rec["generated_tokens"] == int(mask.sum()) and rec["masked_tokens"] == n - mask.sum()
    texts, extras = reward_inputs([rec], [{"data_source": "t"}])
    assert texts == ["5"] and extras[0]["tool_rewards"] == {"add": 0.5}
    assert extras[0]["messages"][1] == {"role": "tool", "name": "add", "content": "5"}
    # The score goes on the last generated token (after the hole), not at mask.sum() - 1.
    rewards = token_level_rewards(torch.tensor([1.0]), mask.unsqueeze(0))
    assert int(rewards[0].nonzero()) == n - 1


def test_episodes_stop_at_no_call_max_turns_and_budget(tok):
    def script(prompt, turn):
        if prompt == "stop":
            return "42"
        if prompt == "loop":
            return call("add", a=1, b=1)
        return call("add", a=1, b=1) + "x" * 40  # "long": spends the budget

    mt, ex = rollout(tok, script, [Add()], max_turns=3)
    with ex:
        out = mt.generate(prompts_for(tok, ["stop", "loop", "long"]), SamplingParams(160))
    recs = episode_records(out)
    assert [r["turns"] for r in recs] == [1, 3, 2]
    assert [r["finished"] for r in recs] == [True, True, False]
    assert recs[2]["truncated"] and not recs[1]["truncated"]
    assert len(recs[1]["calls"]) == 2  # the third turn's call is never run: out of turns
    assert out["response_mask"][2].sum() + recs[2]["masked_tokens"] == 160  # budget over all turns


# ----------------------------------------------------------------- failures finish the step


def test_each_tool_failure_is_an_observation_and_the_rollout_finishes(tok):
    bad = {
        "malformed": "<tool_call>{not json</tool_call>",
        "unknown": call("mul", a=1, b=2),
        "badargs": call("add", a="x", b=2),
        "boom": call("boom"),
        "hang": call("hang"),
    }

    def script(prompt, turn):
        return bad[prompt] if turn == 0 else "done"

    mt, ex = rollout(tok, script, [Add(), Boom(), Hang()], timeout=0.3)
    with ex:
        out = mt.generate(prompts_for(tok, list(bad)), SamplingParams(400))
    recs = episode_records(out)
    statuses = [r["calls"][0]["status"] for r in recs]
    assert statuses == ["malformed", "unknown_tool", "bad_arguments", "error", "timeout"]
    for r in recs:
        assert r["turns"] == 2 and r["finished"] and r["answer"] == "done"
        assert r["messages"][1]["content"].startswith("error: ")
    m = episode_metrics(recs, "rollout")
    assert m["rollout/multi_turn/malformed_calls"] == 1
    assert m["rollout/multi_turn/unknown_tool_calls"] == 1
    assert m["rollout/tools/add/errors"] == 1 and m["rollout/tools/boom/errors"] == 1
    assert m["rollout/tools/hang/timeouts"] == 1 and m["rollout/tools/hang/errors"] == 0


# ----------------------------------------------------------------- concurrency


def test_64_episodes_of_two_turns_wait_on_their_tools_together(tok):
    def script(prompt, turn):
        return call("sleep") if turn == 0 else "5"

    mt, ex = rollout(tok, script, [Sleep()])
    prompts = prompts_for(tok, [str(i) for i in range(64)])
    with ex:
        t0 = time.perf_counter()
        out = mt.generate(prompts, SamplingParams(96))
        wall = time.perf_counter() - t0
    recs = episode_records(out)
    assert all(r["turns"] == 2 and r["calls"][0]["status"] == "ok" for r in recs)
    assert mt.engine.calls == 2  # batched turns: one generate per turn for all 64 episodes
    assert wall < 64 * 0.2 / 4, f"64 episodes took {wall:.2f} s; serial would be 12.8 s"


# ----------------------------------------------------------------- what training sees


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return build_tiny_model(TinySpec(), tok).eval()


@pytest.fixture(scope="module")
def batch(tok):
    def script(prompt, turn):
        if prompt == "a":
            return ["", call("add", a=1, b=2)][turn == 0] or "3"
        return [call("add", a=20, b=22), call("add", a=1, b=1), "42"][turn]

    mt, ex = rollout(tok, script, [Add()])
    with ex:
        return mt.generate(prompts_for(tok, ["a", "bb"]), SamplingParams(200))


@pytest.mark.parametrize("share_prompt", [False, True], ids=["full-pass", "shared-prompt"])
def test_loss_gradient_is_exactly_zero_at_tool_and_template_positions(model, batch, share_prompt):
    logits = response_logits(model, batch, temperature=1.0, share_prompt=share_prompt)
    logits.retain_grad()
    mask = batch["response_mask"]
    log_prob = token_log_probs(logits, batch["responses"])
    old = log_prob.detach() + 0.1 * torch.randn_like(log_prob)
    adv = torch.randn_like(log_prob)
    pg, _ = algos.policy_loss(old, log_prob, adv, mask, agg="token-mean")
    ent = algos.aggregate(algos.entropy_from_logits(logits), mask, "token-mean")
    kl = algos.aggregate(algos.kl_penalty(log_prob, old, "k3"), mask, "token-mean")
    (pg - 0.01 * ent + 0.1 * kl).backward()
    grad = logits.grad.abs().sum(-1)
    real = batch["attention_mask"][:, batch["prompts"].shape[1] :].bool()
    tool_positions = real & ~mask.bool()
    assert tool_positions.sum() > 10  # there are tool/template tokens to check
    assert torch.equal(grad[tool_positions], torch.zeros_like(grad[tool_positions]))
    assert (grad[mask.bool()] > 0).all()


@pytest.mark.parametrize("share_prompt", [False, True], ids=["full-pass", "shared-prompt"])
def test_logits_across_turns_equal_each_conversation_run_alone(model, batch, share_prompt):
    with torch.no_grad():
        logits = response_logits(model, batch, temperature=1.0, share_prompt=share_prompt)
        p = batch["prompts"].shape[1]
        for i in range(batch.batch_size[0]):
            keep = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][keep].unsqueeze(0)
            alone = model(input_ids=ids).logits[0].float()
            n_resp = int(keep[p:].sum())
            got = logits[i, :n_resp]
            want = alone[-n_resp - 1 : -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
