"""The lookup tool behind a simulated remote API: the same answers, after a seeded latency."""

from __future__ import annotations

import asyncio
import time

import pytest

from trainer.rollout.tools.loading import load_tools
from trainer.rollout.tools.lookup import LookupTool
from trainer.rollout.tools.remote import RemoteLookupTool


async def _ask(tool, key):
    state = await tool.create(table={1: "a", 2: "b"}, key=2)
    answer = await tool.execute({} if key is None else {"key": key}, state)
    return answer, await tool.reward(state)


def test_it_answers_and_rewards_as_the_lookup_tool():
    for key in (None, 1, 2):
        assert asyncio.run(_ask(RemoteLookupTool(0.0, 0.0), key)) == asyncio.run(
            _ask(LookupTool(), key)
        )
    with pytest.raises(KeyError, match="no key 9"):
        asyncio.run(_ask(RemoteLookupTool(0.0, 0.0), 9))


def test_latencies_fall_in_the_range_and_repeat_with_the_seed():
    draws = [RemoteLookupTool(0.1, 0.5, seed=3).latency() for _ in range(2)]
    assert draws[0] == draws[1]
    tool = RemoteLookupTool(0.1, 0.5, seed=3)
    assert all(0.1 <= tool.latency() <= 0.5 for _ in range(200))


def test_concurrent_calls_wait_together_not_one_after_another():
    tool = RemoteLookupTool(0.2, 0.2)

    async def many():
        return await asyncio.gather(*(_ask(tool, 1) for _ in range(20)))

    t0 = time.perf_counter()
    answers = asyncio.run(many())
    assert [a for a, _ in answers] == ["a"] * 20
    # 20 waits of 0.2 s one after another would take 4 s.
    assert time.perf_counter() - t0 < 2.0


def test_a_bad_range_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"latency range \[0.5, 0.1\]"):
        RemoteLookupTool(0.5, 0.1)


def test_it_loads_by_name_as_the_docs_say():
    (tool,) = load_tools(["trainer.rollout.tools.remote:RemoteLookupTool"])
    assert isinstance(tool, RemoteLookupTool) and tool.name == "lookup"
