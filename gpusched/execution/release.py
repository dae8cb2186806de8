"""When a real card may be handed out again: NVML must show the job gone and the memory back.

A test process that has exited can leave its card busy for a while: the driver
tears the CUDA context down asynchronously, and a leaked child may still hold
memory. Handing the card to the next file too early makes that file fail with
an out-of-memory error that is not its fault. So after a job ends, each of its
cards is polled until NVML lists no process of the job on it and its used
memory is under a threshold; a card that does not come back within
``--gpu-release-timeout`` is quarantined: never handed out again in this run,
and named in the summary.

The NVML calls go through a small ``NvmlLayer`` protocol so that the waiting
logic is tested with a fake layer; ``PynvmlLayer`` is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from gpusched.requirements import format_memory

DEFAULT_RELEASE_TIMEOUT = 30.0
DEFAULT_RELEASE_MEMORY = 1 << 30  # 1 GiB: an idle card reports a few hundred MiB in use
DEFAULT_POLL = 0.25


class NvmlLayer(Protocol):
    """The two NVML readings the release check needs, per card id (as in ``CUDA_VISIBLE_DEVICES``)."""

    def processes(self, card: str) -> frozenset[int]:
        """Pids that have a context on the card (compute and graphics)."""
        ...

    def used_memory(self, card: str) -> int:
        """Bytes in use on the card."""
        ...


@dataclass(frozen=True)
class CardReading:
    """One poll of one card: which of the job's pids NVML still lists on it, and memory in use."""

    card: str
    job_pids: frozenset[int]
    used: int


def blocker(reading: CardReading, threshold: int) -> str | None:
    """Why the card is not free yet, or ``None`` if it may be handed out again."""
    reasons = []
    if reading.job_pids:
        reasons.append("job process(es) " + ",".join(map(str, sorted(reading.job_pids))))
    if reading.used > threshold:
        reasons.append(
            f"{format_memory(reading.used)} in use (threshold {format_memory(threshold)})"
        )
    return "; ".join(reasons) or None


def read_card(layer: NvmlLayer, card: str, pids: frozenset[int]) -> CardReading:
    return CardReading(card, layer.processes(card) & pids, layer.used_memory(card))


class NvmlRelease:
    """The runner's ``CardReleaser`` for real cards: wait for NVML to show each card free.

    Called by the runner once no process of the job is alive, with the job's
    cards and every pid the kill sweep saw. Polls all the cards together; after
    ``timeout`` seconds the ones still busy are returned (quarantined) and
    ``warn`` is told why. ``quarantined`` keeps every card and reason of the run.
    """

    def __init__(
        self,
        layer: NvmlLayer,
        timeout: float = DEFAULT_RELEASE_TIMEOUT,
        threshold: int = DEFAULT_RELEASE_MEMORY,
        *,
        poll: float = DEFAULT_POLL,
        warn: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if timeout < 0:
            raise ValueError(f"gpu release timeout must not be negative, got {timeout}")
        if threshold < 0:
            raise ValueError(f"gpu release memory threshold must not be negative, got {threshold}")
        self.layer = layer
        self.timeout = timeout
        self.threshold = threshold
        self.poll = poll
        self.warn = warn
        self.clock = clock
        self.sleep = sleep
        self.quarantined: dict[str, str] = {}

    async def release(self, cards: tuple[str, ...], pids: frozenset[int]) -> list[str]:
        """Wait until every card is free; return the ids that did not come back in time."""
        deadline = self.clock() + self.timeout
        waiting = list(cards)
        while True:
            readings = await asyncio.to_thread(self._read, waiting, pids)
            reasons = {r.card: why for r in readings if (why := blocker(r, self.threshold))}
            waiting = [card for card in waiting if card in reasons]
            if not waiting:
                return []
            if self.clock() >= deadline:
                for card in waiting:
                    why = f"still busy {self.timeout:g}s after its job ended: {reasons[card]}"
                    self.quarantined[card] = why
                    if self.warn is not None:
                        self.warn(f"gpusched: card {card} quarantined: {why}")
                return waiting
            await self.sleep(self.poll)

    def _read(self, cards: Iterable[str], pids: frozenset[int]) -> list[CardReading]:
        return [read_card(self.layer, card, pids) for card in cards]


class PynvmlLayer:
    """``NvmlLayer`` over nvidia-ml-py. Card ids are NVML indices, as ``inventory`` reports them.

    Opens NVML on construction and closes it in ``close`` (or at the end of a
    ``with`` block). Raises ``RuntimeError`` if NVML cannot be opened.
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError("the GPU release check needs nvidia-ml-py (pynvml)") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"cannot open NVML for the GPU release check: {exc}") from exc
        self._nvml = pynvml
        self._handles: dict[str, object] = {}

    def _handle(self, card: str) -> object:
        if card not in self._handles:
            self._handles[card] = self._nvml.nvmlDeviceGetHandleByIndex(int(card))
        return self._handles[card]

    def processes(self, card: str) -> frozenset[int]:
        handle = self._handle(card)
        pids: set[int] = set()
        for query in (
            self._nvml.nvmlDeviceGetComputeRunningProcesses,
            self._nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            pids.update(int(info.pid) for info in query(handle))
        return frozenset(pids)

    def used_memory(self, card: str) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle(card)).used)

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def __enter__(self) -> PynvmlLayer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def release_check(
    real: bool, timeout: float, threshold: int, warn: Callable[[str], None] | None = None
) -> Iterator[NvmlRelease | None]:
    """The releaser for a run: NVML-backed on real cards, ``None`` (release at once) otherwise.

    Simulated cards hold no memory, so the runner frees them as soon as the
    job's processes are gone. NVML stays open for the ``with`` block.
    """
    if not real:
        yield None
        return
    with PynvmlLayer() as layer:
        yield NvmlRelease(layer, timeout, threshold, warn=warn)
