"""Tools on their own: call parsers, schema checks, loading, and the executor's failure modes.

Every failure a tool or a model can produce must come back as a
``CallOutcome`` whose observation says what went wrong: nothing raises.
The concurrency test runs 64 calls of a tool that sleeps 0.2 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from trainer.models import build_char_tokenizer
from trainer.rollout.tools import (
    CompactParser,
    HermesParser,
    Tool,
    ToolArgumentError,
    ToolCall,
    ToolExecutor,
    check_arguments,
    load_tool,
    load_tools,
    resolve_format,
    select_parser,
)
from trainer.rollout.tools.lookup import LookupTool


class Add(Tool):
    name = "add"
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        return str(arguments["a"] + arguments["b"])


class Echo(Tool):
    name = "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": []}

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        return arguments.get("text", "")


# ----------------------------------------------------------------- Hermes parser


def test_hermes_parses_one_call_and_keeps_the_content():
    turn = HermesParser().parse(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert turn.content == "Let me add."
    assert turn.calls == [
        ToolCall("add", {"a": 1, "b": 2}, raw='{"name": "add", "arguments": {"a": 1, "b": 2}}')
    ]


def test_hermes_parses_several_calls_in_one_turn_in_order():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
    )
    calls = HermesParser().parse(text).calls
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("echo", {"text": "hi"}, None),  # JSON-encoded arguments are decoded
    ]


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not JSON"),
        ('<tool_call>["add"]</tool_call>', 'expected {"name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
    ],
)
def test_hermes_malformed_calls_come_back_with_an_error(text, error):
    (call,) = HermesParser().parse(text).calls
    assert call.error is not None and error in call.error


def test_hermes_text_without_calls_is_all_content():
    turn = HermesParser().parse("The answer is 3.")
    assert turn.calls == [] and turn.content == "The answer is 3."


# ----------------------------------------------------------------- compact parser


def test_compact_single_tool_needs_no_name_and_converts_types():
    turn = CompactParser([LookupTool()]).parse("~7")
    assert turn.calls == [ToolCall("lookup", {"key": 7}, raw="~7")] and turn.content == ""
    # Optional trailing parameters may be left out.
    assert CompactParser([LookupTool()]).parse("~").calls == [ToolCall("lookup", {}, raw="~")]


def test_compact_several_named_calls_one_per_line_with_content_before():
    turn = CompactParser([Add(), Echo()]).parse("12 ~add:1,2\n~echo:hi\n~add:3,4")
    assert turn.content == "12"
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("echo", {"text": "hi"}),
        ("add", {"a": 3, "b": 4}),
    ]


@pytest.mark.parametrize(
    "text, error",
    [
        ("~add:1", "takes 2 argument(s), got 1"),
        ("~add:1,x", "b='x' is not integer"),
        ("~1,2", "expected ~name:arguments"),  # no name with two tools
        ("~echo:a,b", "echo takes 0-1 argument(s), got 2"),
    ],
)
def test_compact_malformed_calls_come_back_with_an_error(text, error):
    (call,) = CompactParser([Add(), Echo()]).parse(text).calls
    assert call.error is not None and error in call.error


def test_compact_unknown_name_is_left_to_the_executor():
    (call,) = CompactParser([Add(), Echo()]).parse("~mul:2,3").calls
    assert call.name == "mul" and call.error is None


# ----------------------------------------------------------------- format choice


def test_format_auto_is_compact_for_the_tiny_tokenizer_and_hermes_with_a_tool_call_token():
    tok = build_char_tokenizer()
    assert resolve_format("auto", tok) == "compact"
    assert isinstance(select_parser("auto", tok, [LookupTool()]), CompactParser)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert resolve_format("auto", tok) == "hermes"
    assert isinstance(select_parser("auto", tok, [LookupTool()]), HermesParser)
    with pytest.raises(ValueError, match="rollout.multi_turn.format='xml'"):
        resolve_format("xml", tok)


# ----------------------------------------------------------------- arguments and loading


def test_check_arguments_names_what_is_wrong():
    add = Add()
    assert check_arguments(add, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    for args, msg in [
        ([1, 2], "must be an object"),
        ({"a": 1}, "missing argument"),
        ({"a": 1, "b": 2, "c": 3}, "unknown argument"),
        ({"a": "1", "b": 2}, "a must be integer"),
        ({"a": True, "b": 2}, "a must be integer"),
    ]:
        with pytest.raises(ToolArgumentError, match=msg):
            check_arguments(add, args)


def test_tools_load_by_dotted_path_and_from_a_file(tmp_path):
    assert isinstance(load_tool("trainer.rollout.tools.lookup:LookupTool"), LookupTool)
    assert isinstance(load_tool("trainer.rollout.tools.lookup.LookupTool"), LookupTool)
    f = tmp_path / "my_tools.py"
    f.write_text(
        "from trainer.rollout.tools import Tool\n"
        "class Upper(Tool):\n"
        "    name = 'upper'\n"
        "    async def execute(self, arguments, state):\n"
        "        return 'X'\n"
        "class NotATool:\n"
        "    pass\n"
        "class Nameless(Tool):\n"
        "    pass\n"
    )
    tool = load_tool(f"{f}:Upper")
    assert tool.name == "upper" and tool.schema()["function"]["name"] == "upper"
    with pytest.raises(TypeError, match="NotATool does not subclass trainer.rollout.tools.Tool"):
        load_tool(f"{f}:NotATool")
    with pytest.raises(TypeError, match="has no name"):
        load_tool(f"{f}:Nameless")
    with pytest.raises(AttributeError, match="rollout.multi_turn.tools=.*has no tool 'Missing'"):
        load_tool(f"{f}:Missing")
    with pytest.raises(ValueError, match="several tools are named upper"):
        load_tools([f"{f}:Upper", f"{f}:Upper"])


# ----------------------------------------------------------------- executor failure modes


class Boom(Tool):
    name = "boom"

    async def execute(self, arguments, state):
        raise RuntimeError("kaput")


class Hang(Tool):
    """Sleeps for ever and swallows the first cancellation: must still be abandoned."""

    name = "hang"

    async def execute(self, arguments, state):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)
        return "never"


class NotText(Tool):
    name = "nottext"

    async def execute(self, arguments, state):
        return 42


class BadCreate(Tool):
    name = "badcreate"

    async def create(self, **kwargs):
        raise OSError("no sandbox")

    async def execute(self, arguments, state):
        return "unreachable"


@pytest.fixture
def executor():
    tools = [Add(), Boom(), Hang(), NotText(), BadCreate()]
    with ToolExecutor(tools, timeout=0.3, max_concurrency=8) as ex:
        yield ex


@pytest.mark.parametrize(
    "call, status, says",
    [
        (ToolCall("add", {"a": 1, "b": 2}), "ok", "3"),
        (ToolCall(None, error="malformed tool call: not JSON"), "malformed", "not JSON"),
        (ToolCall("nope", {}), "unknown_tool", "unknown tool 'nope'"),
        (ToolCall("add", {"a": 1}), "bad_arguments", "missing argument(s) b"),
        (ToolCall("boom", {}), "error", "RuntimeError: kaput"),
        (ToolCall("hang", {}), "timeout", "timed out after 0.3 s"),
        (ToolCall("nottext", {}), "error", "returned int, not text"),
        (ToolCall("badcreate", {}), "error", "create failed: OSError: no sandbox"),
    ],
    ids=["ok", "malformed", "unknown", "bad-args", "exception", "timeout", "not-text", "create"],
)
def test_every_failure_becomes_an_observation(executor, call, status, says):
    async def run():
        states = await executor.create_states({})
        outcome = await executor.call(call, states)
        rewards = await executor.finish_states(states)
        return outcome, rewards

    outcome, rewards = executor.run(run())
    assert outcome.status == status
    assert says in outcome.observation
    assert status == "ok" or outcome.observation.startswith("error: ")
    assert rewards == {"add": 0.0, "boom": 0.0, "hang": 0.0, "nottext": 0.0, "badcreate": 0.0}


class Sleep(Tool):
    """Sleeps 0.2 s per call and records how many calls overlapped at most."""

    name = "sleep"
    running = 0
    peak = 0

    async def execute(self, arguments, state):
        cls = type(self)
        cls.running += 1
        cls.peak = max(cls.peak, cls.running)
        try:
            await asyncio.sleep(0.2)
        finally:
            cls.running -= 1
        return "done"


@pytest.mark.parametrize("bound", [64, 8])
def test_calls_run_concurrently_up_to_the_bound(bound):
    Sleep.peak = 0
    with ToolExecutor([Sleep()], timeout=5, max_concurrency=bound) as ex:

        async def run():
            return await asyncio.gather(*(ex.call(ToolCall("sleep", {}), {}) for _ in range(64)))

        t0 = time.perf_counter()
        outcomes = ex.run(run())
        wall = time.perf_counter() - t0
    assert [o.status for o in outcomes] == ["ok"] * 64
    assert Sleep.peak == bound  # the bound is reached and never exceeded
    # Serially 64 x 0.2 s = 12.8 s; bounded by 8, 8 waves of 0.2 s. Generous margins.
    assert wall < (64 / bound) * 0.2 * 4 + 1.0, wall


def test_lookup_tool_reads_this_episodes_table_and_rewards_the_questions_key():
    tool = LookupTool()
    table = {str(k): str((3 * k) % 10) for k in range(10)}

    async def episode(*keys):
        state = await tool.create(table=table, key=4)
        seen = [await tool.execute({} if k is None else {"key": k}, state) for k in keys]
        return seen, await tool.reward(state)

    assert asyncio.run(episode(None)) == (["2"], 1.0)  # no key: the question's key
    assert asyncio.run(episode(7)) == (["1"], 0.0)
    assert asyncio.run(episode(7, 4)) == (["1", "2"], 1.0)
    with pytest.raises(KeyError, match="no key 12"):
        asyncio.run(episode(12))
    with pytest.raises(ValueError, match="tools_kwargs.lookup.table"):
        asyncio.run(tool.create())


def test_the_documented_calculator_tool_works_as_the_docs_say(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    start = doc.index("```python\n# my_tools.py\n") + len("```python\n")
    f = tmp_path / "my_tools.py"
    f.write_text(doc[start : doc.index("```", start)])
    calc = load_tool(f"{f}:Calculator")
    assert calc.schema()["function"]["parameters"]["required"] == ["expression"]
    with ToolExecutor([calc], timeout=5, max_concurrency=4) as ex:

        async def episode():
            states = await ex.create_states({"calculator": {"answer": "84"}})
            ok = await ex.call(ToolCall("calculator", {"expression": "12*(3+4)"}), states)
            bad = await ex.call(ToolCall("calculator", {"expression": "__import__('os')"}), states)
            return ok, bad, await ex.finish_states(states)

        ok, bad, rewards = ex.run(episode())
    assert (ok.status, ok.observation) == ("ok", "84")
    assert bad.status == "error" and "unsupported characters" in bad.observation
    assert rewards == {"calculator": 0.1}
