"""From a streaming collection to the runner: each file becomes a job as soon as it is collected.

``Feeder`` hears the collection's events (``gpusched.collection.stream``): a
collected file is turned into a job and submitted to the running runner at
once (or, if the fork server started it before collection began, adopted); a
collection error or module skip is reported at once. When the collection is
done, ``finish`` reconciles what was streamed with the final report, which
stays the truth: files not streamed are submitted, a pending job whose entry
changed is replaced, and early starts whose file was never collected are
stopped and forgotten.

Ordering: a file enters the packing when it arrives; the packing's order is
unchanged (most cards first, then longest expected). A file the history does
not know is expected to take the history's mean, or as long as collecting it
took if that is longer: its child collects it again, so that is a lower bound
of its run, and a file that was slow to collect (thousands of parametrized
cases) goes ahead of the small files queued before it. With no history at all,
files of one size and quick to collect start in collection order. Holding files
back until collection ends would let largest-first see every file, but would
cost the whole collection time on every card and slot. From the second run on,
the history orders by duration (and the longest known files start before
collection begins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpusched.collection.collect import CollectedFile, CollectError, Collection
from gpusched.collection.stream import (
    FileFailed,
    FileFound,
    FileSkipped,
    Rooted,
    StreamEvent,
    StreamOff,
)
from gpusched.execution.forkclient import ForkServer
from gpusched.execution.runner import Child, stop_early
from gpusched.history import DEFAULT_SECONDS, Entry, history_key
from gpusched.requirements import Requirement
from gpusched.results import DEFERRED, FileResult, Outcome, TestResult, expectation
from gpusched.scheduling import Job


def error_result(error: CollectError) -> FileResult:
    """A file that never reaches the runner because pytest could not collect it."""
    return FileResult(
        error.path,
        Outcome.ERROR,
        message="collection error",
        tests=[TestResult(error.nodeid, "error", 0.0, error.message)],
    )


def skip_result(skip: CollectError) -> FileResult:
    """A file skipped as a whole at import."""
    return FileResult(
        skip.path,
        Outcome.SKIPPED,
        message=skip.message,
        tests=[TestResult(skip.nodeid, "skipped", 0.0, skip.message)],
    )


class JobSink(Protocol):
    """Where the feeder's jobs go: the local ``Runner``, or the driver of a ``--ray`` run
    (``gpusched.execution.cluster.driver.ClusterRun``), each with its input open."""

    @property
    def stopping(self) -> bool: ...

    @property
    def tests(self) -> dict[str, Sequence[str]]: ...

    def submit(
        self,
        jobs: Sequence[Job],
        tests: Mapping[str, Sequence[str]] | None = None,
        expect: Mapping[str, str] | None = None,
    ) -> None: ...

    def revise(self, job: Job, tests: Sequence[str], expect: str | None) -> bool: ...

    def adopt(self, job: Job, child: Child, tests: Sequence[str] = ()) -> None: ...

    def release_reserved(self) -> None: ...

    def stop(self, reason: str) -> None: ...

    def close_input(self) -> None: ...


class Backlog:
    """Collection events heard before their ``JobSink`` exists, handed on once it does.

    A ``--ray`` run collects while it connects to the cluster and starts the
    node agents: a file's requirement cannot be fitted to nodes not yet known.
    The collection's first event names its rootdir (the directory shipped to the
    nodes): it is kept in ``rootdir`` as soon as it is heard.
    """

    def __init__(self) -> None:
        self.rootdir: str | None = None
        self.held: list[StreamEvent] = []
        self._target: Callable[[StreamEvent], None] | None = None

    def on_event(self, event: StreamEvent) -> None:
        if isinstance(event, Rooted):
            self.rootdir = event.rootdir
        if self._target is None:
            self.held.append(event)
        else:
            self._target(event)

    def open(self, target: Callable[[StreamEvent], None]) -> None:
        """Hand the held events to ``target`` in the order heard, and every later one at once."""
        held, self.held = self.held, []
        for event in held:
            target(event)
        self._target = target


@dataclass
class Feeder:
    """Turns collection events into jobs for ``runner``; lives on the runner's event loop."""

    runner: JobSink
    refit: Callable[[Requirement, tuple[Requirement, ...]], Requirement]
    history: Mapping[str, Entry]
    report: Callable[[FileResult], None]  # collection errors and skips, as they are found
    early: dict[str, Child] = field(default_factory=dict)  # path -> child started before
    server: ForkServer | None = None
    rootdir: str = "."
    jobs: dict[str, Job] = field(default_factory=dict)  # path -> job, in arrival order
    entries: dict[str, CollectedFile] = field(default_factory=dict)  # what each job was made from
    results: list[FileResult] = field(default_factory=list)  # collection errors and skips
    started_early: int = 0  # early starts adopted
    off: str | None = None  # why the stream was not used
    grow: Callable[[int], None] | None = None  # the live view's total: files found so far
    collected: Callable[[], None] | None = None  # told once the collection is done

    def __post_init__(self) -> None:
        self._reported: set[tuple[str, str]] = set()
        self._fallback = (
            sum(entry.seconds for entry in self.history.values()) / len(self.history)
            if self.history
            else DEFAULT_SECONDS
        )

    @property
    def stopping(self) -> bool:
        return self.runner.stopping

    def on_event(self, event: StreamEvent) -> None:
        """Take in one event of the streaming collection."""
        if self.stopping:
            return  # -x or an interrupt: nothing more starts
        match event:
            case Rooted(rootdir):
                self.rootdir = rootdir
            case FileFound(file):
                self.add([file], predicted=True)
            case FileFailed(error):
                self._report(error_result(error), error)
            case FileSkipped(skip):
                self._report(skip_result(skip), skip)
            case StreamOff(reason):
                self.off = reason

    def add(self, files: Sequence[CollectedFile], predicted: bool) -> None:
        """Submit new files as jobs; ``predicted``: their child checks the entry (streamed)."""
        before = len(self.jobs)
        jobs: list[Job] = []
        tests: dict[str, tuple[str, ...]] = {}
        expect: dict[str, str] = {}
        for file in files:
            if file.path in self.jobs:
                continue
            entry = self.history.get(history_key(file.path, self.rootdir))
            job = Job(
                len(self.jobs),
                file.path,
                self.refit(file.requirement, file.levels),
                self._expected(file),
                entry.cpu if entry is not None else None,
            )
            self.jobs[file.path] = job
            self.entries[file.path] = file
            child = self.early.pop(file.path, None)
            if child is not None and job.gpus == 0:
                self.runner.adopt(job, child, file.tests)
                self.started_early += 1
                continue
            if child is not None:
                self._drop_early(child)
            jobs.append(job)
            tests[file.path] = file.tests
            if file.deferred:
                expect[file.path] = DEFERRED
            elif predicted or file.cached:
                expect[file.path] = expectation(file.requirement, file.tests)
        if jobs:
            self.runner.submit(jobs, tests, expect)
        if self.grow is not None:
            self.grow(len(self.jobs) - before)

    def finish(self, collection: Collection) -> None:
        """Reconcile with the final report; afterwards no early start is left outside the runner."""
        self.rootdir = collection.rootdir
        fresh: list[CollectedFile] = []
        for file in collection.files:
            streamed = self.entries.get(file.path)
            if streamed is None:
                fresh.append(file)
            elif (streamed.requirement, streamed.levels, streamed.tests) != (
                file.requirement,
                file.levels,
                file.tests,
            ):
                self._revise(file)
        if not self.stopping:
            self.add(fresh, predicted=False)
        for error in collection.errors:
            self._report(error_result(error), error)
        for skip in collection.skipped:
            self._report(skip_result(skip), skip)
        self.stop_early()
        if self.collected is not None:
            self.collected()

    def stop_early(self) -> None:
        """Stop the early starts that were not adopted (their file was not collected)."""
        for child in self.early.values():
            self._drop_early(child)
        self.early.clear()

    def _drop_early(self, child: Child) -> None:
        if self.server is not None:
            stop_early(child, self.server)
        self.runner.release_reserved()

    def _revise(self, file: CollectedFile) -> None:
        """The final report saw this file differently from its streamed entry."""
        job = self.jobs[file.path]
        revised = dataclasses.replace(job, requirement=self.refit(file.requirement, file.levels))
        expect = expectation(file.requirement, file.tests) if file.cached else None
        if self.runner.revise(revised, file.tests, expect):
            self.jobs[file.path] = revised
            self.entries[file.path] = file
        else:
            # Already started: its child checks the streamed prediction against its own
            # collection; the final list names the tests if it ends before reporting them.
            self.runner.tests[file.path] = file.tests

    def _report(self, result: FileResult, error: CollectError) -> None:
        key = (error.path, error.nodeid)
        if key in self._reported:
            return
        self._reported.add(key)
        self.results.append(result)
        if self.grow is not None:
            self.grow(1)
        self.report(result)

    def _expected(self, file: CollectedFile) -> float:
        """Seconds from the history; for a file it does not know, the mean of all it knows (the
        whole suite is not known yet), or the file's own collection time if that is longer: its
        child collects it again, so a file takes at least that long."""
        entry = self.history.get(history_key(file.path, self.rootdir))
        return entry.seconds if entry is not None else max(self._fallback, file.seconds)
