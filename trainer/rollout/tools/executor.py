"""Run tool calls concurrently, bounded and timed out, turning every failure into text.

One :class:`ToolExecutor` per rollout worker owns an asyncio event loop in a
daemon thread. The episode loop hands it all calls of one turn of the whole
batch at once (:meth:`ToolExecutor.run`), so episodes wait on their tools
together: 64 episodes whose tool sleeps 0.2 s take about 0.2 s, not 12.8 s.
A semaphore bounds how many calls run at a time
(``rollout.multi_turn.max_concurrency``). A call still running at
``rollout.multi_turn.tool_timeout`` is cancelled and abandoned (never awaited
again, so even a tool that ignores cancellation cannot stall the batch).

Every outcome is a :class:`CallOutcome` with a ``status``; nothing a tool
does raises out of here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from trainer.rollout.tools.base import Tool, ToolArgumentError, check_arguments
from trainer.rollout.tools.parsers import ToolCall

T = TypeVar("T")

#: Outcome statuses. ``ok`` is a normal result; the others are error observations.
STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "error", "timeout")


@dataclass(frozen=True)
class CallOutcome:
    """What one call produced: the observation text and how it went."""

    tool: str | None
    """The tool name the model asked for (None when the call was unreadable)."""
    observation: str
    status: str


class _Unavailable:
    """Episode state of a tool whose ``create`` failed: its calls report this error."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _retrieve(task: asyncio.Future) -> None:
    """Done-callback of an abandoned task: read its outcome so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


class ToolExecutor:
    """Runs tool coroutines on a private event loop with a concurrency bound and a timeout."""

    def __init__(self, tools: list[Tool], timeout: float, max_concurrency: int) -> None:
        if timeout <= 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout={timeout}: must be > 0")
        if max_concurrency < 1:
            raise ValueError(f"rollout.multi_turn.max_concurrency={max_concurrency}: must be >= 1")
        self.tools = {t.name: t for t in tools}
        self.timeout = float(timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tool-executor", daemon=True
        )
        self._thread.start()
        self._sem = self.run(self._make_semaphore(max_concurrency))

    @staticmethod
    async def _make_semaphore(n: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(n)  # created inside the loop it guards

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the executor's loop and wait for its result (called from the worker)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop the loop; abandoned calls still pending die with the daemon thread."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _bounded(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` under the semaphore; ``TimeoutError`` after ``timeout`` (task abandoned)."""
        async with self._sem:
            task = asyncio.ensure_future(fn())
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
            if not done:
                task.cancel()
                task.add_done_callback(_retrieve)
                raise TimeoutError(f"no result within {self.timeout:g} s")
            return task.result()

    # ------------------------------------------------------------- episode life cycle

    async def create_states(self, tools_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Each tool's state for a new episode; a failed ``create`` makes the tool unavailable."""

        async def one(tool: Tool) -> Any:
            kwargs = tools_kwargs.get(tool.name) or {}
            try:
                return await self._bounded(lambda: tool.create(**kwargs))
            except Exception as exc:  # noqa: BLE001 - any failure is reported, never raised
                return _Unavailable(f"{tool.name} is unavailable: create failed: {_describe(exc)}")

        states = await asyncio.gather(*(one(t) for t in self.tools.values()))
        return dict(zip(self.tools, states, strict=True))

    async def call(self, call: ToolCall, states: dict[str, Any]) -> CallOutcome:
        """Execute one parsed call against this episode's states; failures become observations."""
        if call.error is not None:
            return CallOutcome(call.name, f"error: {call.error}", "malformed")
        tool = self.tools.get(call.name or "")
        if tool is None:
            known = ", ".join(self.tools)
            return CallOutcome(
                call.name, f"error: unknown tool {call.name!r}; tools: {known}", "unknown_tool"
            )
        state = states.get(tool.name)
        if isinstance(state, _Unavailable):
            return CallOutcome(tool.name, f"error: {state.reason}", "error")
        try:
            args = check_arguments(tool, call.arguments)
        except ToolArgumentError as exc:
            return CallOutcome(tool.name, f"error: {exc}", "bad_arguments")
        try:
            result = await self._bounded(lambda: tool.execute(args, state))
        except TimeoutError:
            return CallOutcome(
                tool.name, f"error: {tool.name} timed out after {self.timeout:g} s", "timeout"
            )
        except ToolArgumentError as exc:
            return CallOutcome(tool.name, f"error: {exc}", "bad_arguments")
        except Exception as exc:  # noqa: BLE001 - a tool's exception is the model's observation
            return CallOutcome(tool.name, f"error: {_describe(exc)}", "error")
        if not isinstance(result, str):
            return CallOutcome(
                tool.name,
                f"error: {tool.name} returned {type(result).__name__}, not text",
                "error",
            )
        return CallOutcome(tool.name, result, "ok")

    async def finish_states(self, states: dict[str, Any]) -> dict[str, float]:
        """Each tool's reward for the episode, then release its state (failures give 0.0)."""

        async def one(tool: Tool) -> float:
            state = states.get(tool.name)
            if isinstance(state, _Unavailable):
                return 0.0
            try:
                value = float(await self._bounded(lambda: tool.reward(state)))
            except Exception:  # noqa: BLE001 - a broken reward is no reward
                value = 0.0
            try:
                await self._bounded(lambda: tool.release(state))
            except Exception:  # noqa: BLE001 - release failures must not end the step
                pass
            return value

        rewards = await asyncio.gather(*(one(t) for t in self.tools.values()))
        return dict(zip(self.tools, rewards, strict=True))
