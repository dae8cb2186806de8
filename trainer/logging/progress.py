"""The fit loop's progress: step, reward, seconds per step and ETA.

On an interactive terminal it is a rich bar, redrawn each step; in CI
(``CI`` true), with ``TERM=dumb`` or when the output is not a terminal it is
plain lines without control codes (gpusched's rule, :func:`gpusched.reporting.live.wants_live`),
one per step at most and at least ``PLAIN_EVERY_S`` apart, besides the first
step, validation steps and the last step, which always print::

    step 5/70: reward 0.412, val 0.390, 3.21 s/step, ETA 3m28s

``python -m trainer`` creates one :class:`Progress` per run and calls
:meth:`Progress.update` from its on-step callback.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from gpusched.reporting.live import wants_live

PLAIN_EVERY_S = 10.0
"""Seconds between plain lines at least (steps slower than this print every step)."""


def format_duration(seconds: float) -> str:
    """``42s``, ``3m28s``, ``1h05m``: whole seconds, two units at most."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def plain_line(
    step: int, total: int, reward: float, seconds_per_step: float, val: float | None = None
) -> str:
    """One plain progress line; ``val`` only at a step that validated."""
    parts = [f"step {step}/{total}: reward {reward:.3f}"]
    if val is not None:
        parts.append(f"val {val:.3f}")
    parts.append(f"{seconds_per_step:.2f} s/step")
    parts.append(f"ETA {format_duration(seconds_per_step * max(0, total - step))}")
    return ", ".join(parts)


class Progress:
    """A rich bar where ``enabled`` and :func:`wants_live` allow it, plain lines otherwise.

    ``enabled`` is false for ``trainer.progress=false`` (and when the caller
    already knows the output is no terminal): plain lines, never a bar.
    Seconds per step are this run's mean since the progress was created,
    so a resumed run's rate starts from its own first step.
    """

    def __init__(
        self,
        enabled: bool,
        total: int,
        start: int,
        *,
        stream: TextIO | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.start = total, start
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.t0 = clock()
        self.last_line: float | None = None
        self.last_val: float | None = None
        self.bar: Any = None
        if enabled and wants_live(self.stream, os.environ if environ is None else environ):
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("val {task.fields[val]}"),
            TextColumn("{task.fields[rate]} s/step"),
            TextColumn("ETA {task.fields[eta]}"),
            TimeElapsedColumn(),
            console=Console(file=self.stream),
        )
        self.bar.start()
        self.task = self.bar.add_task(
            "train", total=self.total, completed=self.start, reward="-", val="-", rate="-", eta="-"
        )

    def seconds_per_step(self, step: int, now: float) -> float:
        return (now - self.t0) / max(1, step - self.start)

    def update(self, step: int, m: Mapping[str, float]) -> None:
        """After step ``step`` with its metrics ``m``: redraw the bar, or maybe print a line."""
        now = self.clock()
        reward = m.get("rollout/reward_mean", math.nan)
        val = m.get("val/reward_mean")
        if val is not None:
            self.last_val = val
        rate = self.seconds_per_step(step, now)
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=step,
                reward=f"{reward:.3f}",
                val="-" if self.last_val is None else f"{self.last_val:.3f}",
                rate=f"{rate:.2f}",
                eta=format_duration(rate * max(0, self.total - step)),
            )
            return
        due = self.last_line is None or now - self.last_line >= PLAIN_EVERY_S
        if due or val is not None or step >= self.total:
            print(plain_line(step, self.total, reward, rate, val), file=self.stream, flush=True)
            self.last_line = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
