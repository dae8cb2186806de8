"""The ``lookup`` tool behind a simulated remote API: every call first waits out a latency.

:class:`RemoteLookupTool` answers exactly as
:class:`~trainer.rollout.tools.lookup.LookupTool` (same name, schema, state
and reward) after ``asyncio.sleep`` of a latency drawn uniformly in
``[low_s, high_s]`` (0.1-0.5 s by default), as a call to a service over the
network would. Calls of one turn wait concurrently, up to
``rollout.multi_turn.max_concurrency`` per worker, like requests in flight.
Named in place of the task's own tool:

    python -m trainer data.task=lookup rollout.multi_turn.enable=true \\
        rollout.multi_turn.tools=[trainer.rollout.tools.remote:RemoteLookupTool]

Another range is an instance in a file of one's own, named by path
(``/path/tools.py:SLOW`` with ``SLOW = RemoteLookupTool(low_s=1.0, high_s=2.0)``).
``bench/async_rl.py`` uses it to give generation a wait the trainer can hide.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from trainer.rollout.tools.lookup import LookupTool

__all__ = ["RemoteLookupTool"]


class RemoteLookupTool(LookupTool):
    """``lookup(key)`` after a latency drawn uniformly in ``[low_s, high_s]`` seconds.

    ``seed`` seeds the draws (one stream per instance, so one per worker); the
    latency never changes what the call returns, only when.
    """

    def __init__(self, low_s: float = 0.1, high_s: float = 0.5, seed: int | None = 0) -> None:
        if not 0 <= low_s <= high_s:
            raise ValueError(f"latency range [{low_s}, {high_s}] s: need 0 <= low_s <= high_s")
        self.low_s, self.high_s = float(low_s), float(high_s)
        self._rng = random.Random(seed)

    def latency(self) -> float:
        """The next call's wait, in seconds."""
        return self._rng.uniform(self.low_s, self.high_s)

    async def execute(self, arguments: dict[str, Any], state: dict[str, Any]) -> str:
        await asyncio.sleep(self.latency())
        return await super().execute(arguments, state)
