"""Synthetic verifiable tasks: the embedded default data.

Each task turns a seed into prompts with a ground truth, and scores a
completion with a rule in [0, 1]. They are small enough for a randomly
initialised character-level model to learn in a few dozen PPO steps, which is
what makes ``python -m trainer`` a meaningful end-to-end check on a CPU.

The train and validation splits come from disjoint seeds (``seed`` and
``seed + 1``), so they differ in order and, where the space is large, in content.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.data.rewards import char_match, exact_match


@dataclass(frozen=True)
class Example:
    """One prompt with the answer its reward is computed against."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra columns (e.g. ``tools_kwargs``), passed on like a data file's."""


@dataclass(frozen=True)
class Task:
    """A named generator of examples plus its reward rule."""

    name: str
    make_one: Callable[[random.Random], Example]
    reward: Callable[..., float]
    max_response_length: int
    tools: tuple[str, ...] = ()
    """Tools the task needs (``rollout.multi_turn.tools`` when that is empty)."""
    max_tool_response_length: int = 256
    """Tokens of a tool result shown to the model (``rollout.multi_turn.max_tool_response_length=0``)."""

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` examples drawn from ``random.Random(seed)``: same seed, same list."""
        if n < 1:
            raise ValueError(f"number of examples must be >= 1, got {n}")
        rng = random.Random(seed)
        return [self.make_one(rng) for _ in range(n)]

    def split(self, n_train: int, n_val: int, seed: int) -> tuple[list[Example], list[Example]]:
        """Train examples from ``seed``, validation examples from ``seed + 1``."""
        return self.examples(n_train, seed), self.examples(n_val, seed + 1)


def _repeat(rng: random.Random) -> Example:
    digit, times = rng.choice("0123456789"), rng.randint(1, 4)
    return Example(prompt=f"{digit}*{times}=", ground_truth=digit * times)


def _reverse(rng: random.Random) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
    return Example(prompt=f"~{digits}=", ground_truth=digits[::-1])


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Example(prompt=f"{a}+{b}=", ground_truth=str(a + b))


LOOKUP_KEYS = 5
LOOKUP_VALUES = "56789"
"""Keys 0-4, values 5-9: a value never looks like a key, so using the result means
answering the digit the tool returned, not telling it apart from the question's
digit by position. With keys and values both 0-9, seeds needed 50-100+ steps to
start copying; with them apart, 50 steps to 0.9 (docs/trainer.md)."""
LOOKUP_TOOL_WEIGHT = 0.3
"""Weight of the tool credit in :func:`lookup_reward` (0.5 left answers empty, see docs)."""


def _lookup(rng: random.Random) -> Example:
    """``key=`` -> the value under ``key`` in a table drawn for this example alone."""
    table = {str(k): rng.choice(LOOKUP_VALUES) for k in range(LOOKUP_KEYS)}
    key = rng.randrange(LOOKUP_KEYS)
    return Example(
        prompt=[{"role": "user", "content": f"{key}="}],
        ground_truth=table[str(key)],
        extra={"tools_kwargs": {"lookup": {"table": table, "key": key}}},
    )


def lookup_reward(
    completion: str,
    ground_truth: str,
    tool_rewards: dict[str, float] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> float:
    """``m + 0.3 * t * (1 - m)``: m = exact match of the answer, t = credit for using the tool.

    t is lookup's tool reward (1 when the episode looked up the key its
    question asks about, by naming it or by leaving the key out), else 0.2
    when it made any call (another key, a malformed call). This shaping lets
    a random-init policy find the call: without it, calling pays only once the
    model has also learned to copy the result, which it cannot learn without
    calling, while a guessed value is right one time in five. A right answer
    scores 1 either way; 0.9 on average needs nearly every answer right.
    """
    tool = (tool_rewards or {}).get("lookup", 0.0) or (0.2 if tool_calls else 0.0)
    match = exact_match(completion, ground_truth)
    return match + LOOKUP_TOOL_WEIGHT * tool * (1.0 - match)


TASKS: dict[str, Task] = {
    "repeat": Task("repeat", _repeat, char_match, max_response_length=5),
    "reverse": Task("reverse", _reverse, char_match, max_response_length=6),
    "add": Task("add", _add, exact_match, max_response_length=4),
    "lookup": Task(
        "lookup",
        _lookup,
        lookup_reward,
        max_response_length=20,
        tools=("trainer.rollout.tools.lookup:LookupTool",),
        max_tool_response_length=4,
    ),
}


def get_task(name: str) -> Task:
    """The task called ``name``; an unknown name lists the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"data.task={name!r}: unknown task; choose one of {sorted(TASKS)}"
        ) from None
