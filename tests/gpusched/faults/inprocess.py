"""Injections that drive gpusched's ``Runner`` in this process, on real child processes.

Used where the fault is in the caller, not in the tests: the runner's task
cancelled from outside (``CancelledError``), a ``KeyboardInterrupt`` raised in
the runner's own frame, and cards whose memory NVML shows held after a job
(a fake NVML layer: there is no GPU driver here).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from deadlines import hang_guard
from faultkit import Observation, Sandbox, alive, observe, read_pids

from gpusched.execution.forkclient import ServerSpec, start_server
from gpusched.execution.release import NvmlRelease
from gpusched.execution.runner import RunConfig, Runner
from gpusched.inventory import Card
from gpusched.reporting.report import summary_lines
from gpusched.requirements import Requirement
from gpusched.results import FileResult
from gpusched.scheduling import Job, Packer


class Recorder:
    """A ``Reporter`` that keeps what it hears; ``on_heartbeat`` lets a scenario act mid-run."""

    def __init__(self, on_heartbeat=None) -> None:
        self.lines: list[str] = []
        self.starts: list[tuple[str, tuple[str, ...]]] = []
        self.on_heartbeat = on_heartbeat

    def started(self, job: Job, cards: tuple[str, ...], attempt: int) -> None:
        self.starts.append((Path(job.path).name, cards))

    def finished(self, result: FileResult) -> None:
        self.lines.append(f"{result.outcome.value} {Path(result.path).name}")

    def interrupting(self, signum: int, second: bool) -> None:
        self.lines.append(f"interrupting {signum} {second}")

    def deselected(self, job: Job) -> None:
        self.lines.append(f"deselected {Path(job.path).name}")

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        if self.on_heartbeat is not None:
            self.on_heartbeat()


@contextlib.contextmanager
def environ_of(box: Sandbox) -> Iterator[None]:
    """Run with the sandbox's environment in ``os.environ`` (the runner's children inherit it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(box.environ())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def build(
    box: Sandbox,
    files: Sequence[tuple[str, int, Sequence[str]]],
    cards: Sequence[str],
    reporter: Recorder,
    releaser: NvmlRelease | None = None,
    heartbeat: float | None = None,
) -> tuple[Runner, list[Job]]:
    """A runner over the sandbox's files: (name, gpus, test names) each, in file order.

    Files are forked by a fork server, as ``gpusched run`` does by default; the
    sandbox closes it.
    """
    work = box.tmp / "work"
    work.mkdir()
    logs = box.root / "logs"
    logs.mkdir(exist_ok=True)
    spec = ServerSpec((), (), os.environ, logs / "forkserver.log", uuid.uuid4().hex[:8], 60.0)
    startup = start_server(spec)
    assert startup.server is not None, startup.reason
    box.on_close.append(startup.server.close)
    config = RunConfig(
        pytest_args=(),
        timeout=hang_guard(60),
        kill_grace=2.0,
        simulated=True,
        log_dir=logs,
        work_dir=work,
        tmp_root=str(box.tmp),
        run_id=uuid.uuid4().hex[:8],
        rootdir=str(box.suite),
        heartbeat=heartbeat,
    )
    jobs = [
        Job(index, str(box.suite / name), Requirement(gpus))
        for index, (name, gpus, _tests) in enumerate(files)
    ]
    tests = {
        str(box.suite / name): [f"{name}::{test}" for test in names] for name, _, names in files
    }
    policy = Packer([Card(card) for card in cards], cpu_slots=1)
    return Runner(config, policy, tests, reporter, releaser, forkserver=startup.server), jobs


def _outcomes(results: list[FileResult]) -> dict[str, str]:
    return {Path(result.path).name: result.outcome.value for result in results}


SLEEPER = """
    import subprocess, sys, time
    from pathlib import Path

    def test_sleep():
        child = subprocess.Popen(
            [sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"]
        )
        Path(__file__).with_name("running.pids").write_text(f"{child.pid}")
        time.sleep(300)
    """
INTERRUPT_SUITE = {"test_a_sleep.py": SLEEPER, "test_b.py": "def test_b():\n    pass\n"}
INTERRUPT_FILES = [("test_a_sleep.py", 0, ["test_sleep"]), ("test_b.py", 0, ["test_b"])]


def _interrupted_observation(box, fault, report, recorder) -> Observation:
    outcomes = _outcomes(report.results)
    child = read_pids(box.suite / "running.pids")
    shutil.rmtree(box.tmp / "work", ignore_errors=True)  # the session's job, done here
    return observe(
        box,
        fault,
        "interrupted; INTERRUPTED + NOT RUN; escaped child killed",
        ("interrupted" if report.interrupted else "not interrupted")
        + f"; {outcomes.get('test_a_sleep.py')} + {outcomes.get('test_b.py')}"
        + ("; escaped child killed" if child and not alive(child) else "; child alive"),
        None,
        outcomes=outcomes,
        lines=recorder.lines,
    )


def cancelled() -> Observation:
    """The runner's task cancelled from outside mid-file (as ``asyncio.run`` does on Ctrl-C)."""
    with Sandbox(INTERRUPT_SUITE) as box, environ_of(box):
        recorder = Recorder()
        runner, jobs = build(box, INTERRUPT_FILES, [], recorder)

        async def main():
            task = asyncio.create_task(runner.run(jobs))
            pids = box.suite / "running.pids"
            for _ in range(1200):  # the test is running and has spawned its child
                if pids.exists() and pids.stat().st_size:
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            return await asyncio.wait_for(task, 60)

        report = asyncio.run(main())
        return _interrupted_observation(
            box, "runner task cancelled (CancelledError)", report, recorder
        )


def keyboard_interrupt() -> Observation:
    """A ``KeyboardInterrupt`` raised in the runner's loop mid-file (at a heartbeat)."""
    with Sandbox(INTERRUPT_SUITE) as box, environ_of(box):
        pids = box.suite / "running.pids"

        def interrupt_once_running() -> None:
            if pids.exists() and pids.stat().st_size:
                raise KeyboardInterrupt

        recorder = Recorder(on_heartbeat=interrupt_once_running)
        runner, jobs = build(box, INTERRUPT_FILES, [], recorder, heartbeat=0.1)
        report = asyncio.run(asyncio.wait_for(runner.run(jobs), 120))
        return _interrupted_observation(
            box, "KeyboardInterrupt in the runner loop", report, recorder
        )


class FakeNvml:
    """An NVML layer whose cards hold memory for some polls after each job (``inf``: forever).

    ``begin`` marks a job's end (called by ``EpisodeRelease``); another user's
    process (pid 1) is always listed on every card and must not block a release.
    """

    HELD, IDLE = 40 * 10**9, 300 * 10**6

    def __init__(self, held_polls: dict[str, float]) -> None:
        self.held_polls = held_polls
        self.polls: dict[str, int] = {}
        self.episodes: list[dict[str, int]] = []

    def begin(self, cards: Sequence[str]) -> None:
        self.polls = {card: 0 for card in cards}
        self.episodes.append(self.polls)

    def processes(self, card: str) -> frozenset[int]:
        return frozenset({1})

    def used_memory(self, card: str) -> int:
        self.polls[card] += 1
        return self.HELD if self.polls[card] <= self.held_polls.get(card, 0) else self.IDLE


class PollClock:
    """Time that passes only in the releaser's own sleeps (which still really sleep).

    The release timeout is then a number of polls, not seconds of a machine
    that may be busy: with the wall clock, three polls of a held card took
    over a second on a loaded CI machine, and card 0 was quarantined too.
    """

    def __init__(self) -> None:
        self.slept = 0.0

    def now(self) -> float:
        return round(self.slept, 6)

    async def sleep(self, seconds: float) -> None:
        self.slept += seconds
        await asyncio.sleep(seconds)


class EpisodeRelease(NvmlRelease):
    """``NvmlRelease`` that tells the fake layer when a job's release begins."""

    async def release(self, cards: tuple[str, ...], pids: frozenset[int]) -> list[str]:
        self.layer.begin(cards)
        return await super().release(cards, pids)


PASS = "def test_ok():\n    pass\n"
RELEASE_SUITE = {
    "test_g2a.py": PASS,
    "test_g2b.py": PASS,
    "test_g1a.py": PASS,
    "test_g1b.py": PASS,
    "test_g1c.py": PASS,
}
RELEASE_FILES = [
    ("test_g2a.py", 2, ["test_ok"]),
    ("test_g2b.py", 2, ["test_ok"]),
    ("test_g1a.py", 1, ["test_ok"]),
    ("test_g1b.py", 1, ["test_ok"]),
    ("test_g1c.py", 1, ["test_ok"]),
]
HOLD_POLLS, POLL, RELEASE_TIMEOUT = 3, 0.1, 1.0


def gpu_release() -> list[Observation]:
    """Item 8 on two simulated cards: card 0 holds memory for 3 polls after each job, card 1 forever."""
    with Sandbox(RELEASE_SUITE) as box, environ_of(box):
        layer = FakeNvml({"0": HOLD_POLLS, "1": float("inf")})
        warnings: list[str] = []
        clock = PollClock()
        releaser = EpisodeRelease(
            layer,
            RELEASE_TIMEOUT,
            10**9,
            poll=POLL,
            warn=warnings.append,
            clock=clock.now,
            sleep=clock.sleep,
        )
        recorder = Recorder()
        runner, jobs = build(box, RELEASE_FILES, ["0", "1"], recorder, releaser)
        report = asyncio.run(asyncio.wait_for(runner.run(jobs), 120))
        shutil.rmtree(box.tmp / "work", ignore_errors=True)
        by_name = {Path(r.path).name: r for r in report.results}
        outcomes = _outcomes(report.results)
        card0 = sorted((r for r in report.results if r.cards == ("0",)), key=lambda r: r.start)
        gaps = [b.start - a.end for a, b in zip(card0, card0[1:], strict=False)]
        held_ok = all(gap >= HOLD_POLLS * POLL * 0.9 for gap in gaps) and len(gaps) == 2
        summary = summary_lines(report.results, report.quarantined)
        quarantined = report.quarantined == ["1"] and any(
            line == "gpusched: quarantined cards: 1" for line in summary
        )
        return [
            observe(
                box,
                "card memory held for 3 polls after each job",
                "card 0 reused only after release; 3 gpu1 files PASSED on it",
                ("card 0 reused only after release" if held_ok else f"gaps {gaps}")
                + f"; {len(card0)} gpu1 files "
                + ",".join(sorted({r.outcome.value for r in card0}))
                + " on it",
                None,
                gaps=gaps,
                episodes=layer.episodes,
            ),
            observe(
                box,
                "card never comes back",
                "card 1 quarantined and reported; gpu2 file left SKIPPED",
                ("card 1 quarantined and reported" if quarantined else f"{report.quarantined}")
                + f"; gpu2 file left {outcomes.get('test_g2b.py')}",
                None,
                reason=by_name["test_g2b.py"].message,
                warnings=warnings,
                first=by_name["test_g2a.py"],
                starts=recorder.starts,
            ),
        ]
