"""Item 8: a real card is handed out again only when NVML shows it free; else it is quarantined."""

from __future__ import annotations

import asyncio

import inprocess
import pytest
from deadlines import hang_guard

from gpusched.execution.release import CardReading, NvmlRelease, blocker


class ScriptedNvml:
    """Readings per card, one per poll; the last one repeats."""

    def __init__(self, script: dict[str, list[tuple[set[int], int]]]) -> None:
        self.script = script
        self.reads = dict.fromkeys(script, 0)

    def _now(self, card: str) -> tuple[set[int], int]:
        steps = self.script[card]
        return steps[min(self.reads[card], len(steps) - 1)]

    def processes(self, card: str) -> frozenset[int]:
        return frozenset(self._now(card)[0])

    def used_memory(self, card: str) -> int:
        used = self._now(card)[1]
        self.reads[card] += 1
        return used


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


GB = 10**9


def _release(layer, timeout=2.0, pids=frozenset({10, 11}), cards=("0",)):
    clock = VirtualClock()
    warnings: list[str] = []
    releaser = NvmlRelease(
        layer, timeout, GB, poll=0.5, warn=warnings.append, clock=clock, sleep=clock.sleep
    )
    busy = asyncio.run(releaser.release(cards, pids))
    return busy, clock.now, releaser, warnings


def test_blocker_names_the_job_pids_and_the_memory():
    assert blocker(CardReading("0", frozenset(), GB // 2), GB) is None
    assert blocker(CardReading("0", frozenset({7, 3}), GB // 2), GB) == "job process(es) 3,7"
    assert blocker(CardReading("0", frozenset(), 2 * GB), GB) == "2GB in use (threshold 1GB)"


def test_card_is_released_once_memory_comes_back():
    layer = ScriptedNvml({"0": [(set(), 30 * GB)] * 3 + [(set(), GB // 4)]})
    busy, waited, releaser, warnings = _release(layer)
    assert busy == [] and waited == 1.5 and layer.reads["0"] == 4
    assert releaser.quarantined == {} and warnings == []


def test_card_waits_for_the_jobs_processes_not_for_others():
    # pid 99 is someone else's process on the card: it does not block; job pid 11 does.
    layer = ScriptedNvml({"0": [({11, 99}, GB // 4), ({99}, GB // 4)]})
    busy, waited, *_ = _release(layer)
    assert busy == [] and waited == 0.5


def test_card_that_never_comes_back_is_quarantined_with_the_reason():
    layer = ScriptedNvml({"0": [(set(), GB // 4)], "1": [({10}, 30 * GB)]})
    busy, waited, releaser, warnings = _release(layer, cards=("0", "1"))
    assert busy == ["1"] and waited == 2.0
    assert "job process(es) 10; 30GB in use" in releaser.quarantined["1"]
    assert warnings == [f"gpusched: card 1 quarantined: {releaser.quarantined['1']}"]


def test_zero_timeout_polls_once():
    layer = ScriptedNvml({"0": [(set(), 30 * GB), (set(), 0)]})
    busy, waited, *_ = _release(layer, timeout=0.0)
    assert busy == ["0"] and waited == 0.0 and layer.reads["0"] == 1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="timeout must not be negative"):
        NvmlRelease(ScriptedNvml({}), -1.0)
    with pytest.raises(ValueError, match="threshold must not be negative"):
        NvmlRelease(ScriptedNvml({}), 1.0, -5)


@pytest.mark.timeout(hang_guard(120))
def test_runner_waits_for_held_memory_and_quarantines_a_dead_card(checked):
    held, dead = inprocess.gpu_release()
    checked(held)
    checked(dead)
    # Card 0 was polled 3 times busy + once free after each job that used it.
    assert all(episode.get("0") == inprocess.HOLD_POLLS + 1 for episode in held.details["episodes"])
    assert dead.details["reason"] == "needs 2 GPUs, 1 available"
    assert "(card(s) 1 quarantined)" in dead.details["first"].message
    assert dead.details["warnings"] and dead.details["warnings"][0].startswith(
        "gpusched: card 1 quarantined: still busy 1s after its job ended"
    )
    assert [cards for name, cards in dead.details["starts"] if "g1" in name] == [("0",)] * 3
