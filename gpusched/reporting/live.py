"""Live progress on a terminal: which file holds each card, elapsed and expected time, counts.

On an interactive terminal ``gpusched run`` redraws a small table (rich) under
the finished-file lines; in CI (``CI=true``) or when the output is not a TTY it
prints the plain lines of ``ConsoleReporter`` and no control codes.
``LiveReporter`` implements the runner's ``Reporter`` protocol; the table is
computed from its state by ``LiveState.rows`` (pure) at each refresh.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpusched.reporting.report import display_path, file_line
from gpusched.results import FAILING, FileResult, Outcome
from gpusched.scheduling import Job

_TRUE = frozenset({"1", "true", "yes", "on"})


def wants_live(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """A live view only on an interactive terminal outside CI (``CI`` unset or false)."""
    if environ.get("CI", "").strip().lower() in _TRUE or environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@dataclass(frozen=True)
class Row:
    """One line of the table: a card or CPU slot, and the file it runs (or idle)."""

    slot: str
    path: str | None = None
    elapsed: float = 0.0
    expected: float | None = None
    attempt: int = 1


@dataclass
class LiveState:
    """What the view shows; changed by the reporter's calls, read by each refresh."""

    cards: tuple[str, ...]
    cpu_slots: int
    total: int
    expected: dict[str, float] = field(default_factory=dict)
    holding: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # slot -> file
    counts: dict[str, int] = field(default_factory=dict)
    done: int = 0
    collecting: bool = False  # the total still grows as collection finds files

    def start(self, job: Job, cards: tuple[str, ...], attempt: int, now: float) -> None:
        """A file runs on ``cards`` (or a CPU slot): only there, wherever it was shown before (a
        file placed again after its child found other cards, or after its node was lost)."""
        for slot in [slot for slot, held in self.holding.items() if held[0] == job.path]:
            del self.holding[slot]
        slots = [f"gpu {card}" for card in cards]
        if not slots:  # the first free CPU row; light files may run more than cpu_slots at once
            slots = [next(f"cpu {i}" for i in itertools.count(1) if f"cpu {i}" not in self.holding)]
        for slot in slots:
            self.holding[slot] = (job.path, now, attempt)
        self.expected[job.path] = job.expected

    def finish(self, result: FileResult) -> None:
        for slot in [slot for slot, held in self.holding.items() if held[0] == result.path]:
            del self.holding[slot]
        name = result.outcome.value.lower()
        self.counts[name] = self.counts.get(name, 0) + 1
        self.done += 1

    def withdraw(self, path: str) -> None:
        """A file that started but selected no test: it leaves the view and the total."""
        for slot in [slot for slot, held in self.holding.items() if held[0] == path]:
            del self.holding[slot]
        self.total -= 1

    def add_slots(self, cards: Sequence[str], cpu_slots: int) -> None:
        """A node joined the run: its cards and CPU slots are rows from now on, idle or not."""
        self.cards += tuple(card for card in cards if card not in self.cards)
        self.cpu_slots += cpu_slots

    def rows(self, now: float) -> list[Row]:
        slots = [f"gpu {card}" for card in self.cards]
        slots += [f"cpu {i + 1}" for i in range(self.cpu_slots)]
        slots += sorted(slot for slot in self.holding if slot not in slots)
        rows = []
        for slot in slots:
            held = self.holding.get(slot)
            if held is None:
                rows.append(Row(slot))
            else:
                path, since, attempt = held
                rows.append(Row(slot, path, now - since, self.expected.get(path), attempt))
        return rows

    def running(self) -> int:
        return len({held[0] for held in self.holding.values()})

    def summary(self, elapsed: float) -> str:
        counts = ", ".join(f"{count} {name}" for name, count in sorted(self.counts.items()))
        pending = max(0, self.total - self.done - self.running())
        return (
            f"{self.done}/{self.total}{'+' if self.collecting else ''} files done"
            + (f" ({counts})" if counts else "")
            + f" | {self.running()} running | {pending} pending"
            + (" | collecting" if self.collecting else "")
            + f" | {elapsed:.0f}s elapsed"
        )


_STYLE = {
    Outcome.PASSED: "green",
    Outcome.FLAKY: "yellow",
    Outcome.SKIPPED: "cyan",
    Outcome.NOT_RUN: "dim",
    Outcome.INTERRUPTED: "magenta",
}


class LiveReporter:
    """The runner's reporter on a terminal: a redrawn table below the finished-file lines.

    Use as a context manager around the run; the session prints the summary after it.
    """

    def __init__(
        self,
        cards: Sequence[str],
        cpu_slots: int,
        total: int,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_per_second: float = 4.0,
        collecting: bool = False,
    ) -> None:
        """``collecting``: files are still being collected (``grow`` adds them to ``total``)."""
        self.state = LiveState(tuple(cards), cpu_slots, total, collecting=collecting)
        self.console = console or Console()
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.Lock()  # rich refreshes from its own thread
        self._live = Live(
            self,
            console=self.console,
            refresh_per_second=refresh_per_second,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def __enter__(self) -> LiveReporter:
        self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.stop()

    def say(self, line: str) -> None:
        self.console.print(Text(line), soft_wrap=True)

    def grow(self, count: int) -> None:
        """Collection found ``count`` more files."""
        with self._lock:
            self.state.total += count
        self._live.refresh()

    def add_slots(self, cards: Sequence[str], cpu_slots: int) -> None:
        """A node joined the run (``LiveState.add_slots``)."""
        with self._lock:
            self.state.add_slots(cards, cpu_slots)
        self._live.refresh()

    def collection_done(self) -> None:
        with self._lock:
            self.state.collecting = False
        self._live.refresh()

    def started(self, job: Job, cards: tuple[str, ...], attempt: int) -> None:
        with self._lock:
            self.state.start(job, cards, attempt, self.clock())
        self._live.refresh()

    def finished(self, result: FileResult) -> None:
        with self._lock:
            self.state.finish(result)
        style = "red" if result.outcome in FAILING else _STYLE.get(result.outcome, "")
        self.console.print(Text(file_line(result), style=style), soft_wrap=True)
        self._live.refresh()

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        """The table already shows each running file's elapsed time: just redraw it."""
        self._live.refresh()

    def deselected(self, job: Job) -> None:
        with self._lock:
            self.state.withdraw(job.path)
        self._live.refresh()

    def interrupting(self, signum: int, second: bool) -> None:
        if second:
            self.say("gpusched: interrupted again: killing every running file now")
        else:
            self.say("gpusched: interrupted: stopping running files (again to kill at once)")

    def __rich__(self) -> Group:
        now = self.clock()
        with self._lock:
            rows = self.state.rows(now)
            summary = self.state.summary(now - self.t0)
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
        table.add_column("slot")
        table.add_column("file", overflow="ellipsis", no_wrap=True, max_width=70)
        table.add_column("elapsed", justify="right")
        table.add_column("expected", justify="right")
        for row in rows:
            if row.path is None:
                table.add_row(row.slot, Text("idle", style="dim"), "", "")
                continue
            late = row.expected is not None and row.elapsed > row.expected
            again = f" (attempt {row.attempt})" if row.attempt > 1 else ""
            table.add_row(
                row.slot,
                display_path(row.path) + again,
                Text(f"{row.elapsed:.1f}s", style="yellow" if late else ""),
                "" if row.expected is None else f"{row.expected:.1f}s",
            )
        return Group(table, Text(summary, style="bold"))
