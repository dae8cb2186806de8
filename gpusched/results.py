"""Outcomes of files and tests, and the pure rules that turn a child's exit into them."""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from gpusched.requirements import Requirement


class Outcome(StrEnum):
    """What happened to one file."""

    PASSED = "PASSED"
    FAILED = "FAILED"
    FLAKY = "FLAKY"  # failed, then passed on a rerun
    ERROR = "ERROR"  # could not be collected, or pytest itself failed
    TIMEOUT = "TIMEOUT"
    CRASHED = "CRASHED"
    INTERRUPTED = "INTERRUPTED"
    NOT_RUN = "NOT RUN"
    SKIPPED = "SKIPPED"


FAILING = frozenset({Outcome.FAILED, Outcome.ERROR, Outcome.TIMEOUT, Outcome.CRASHED})


@dataclass
class JunitElement:
    """One child of a ``<testcase>``: ``failure``, ``error``, ``skipped``, ``system-out`` or
    ``system-err``, with its attributes and text as pytest's junitxml writes them."""

    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    text: str | None = None


@dataclass
class JunitCase:
    """One ``<testcase>`` that pytest's junitxml writes for a test: usually one per test,
    two when the call failed and the teardown errored too. Built in the child
    (``gpusched.reporting.junit.JunitCases``), written by the parent as they are."""

    time: float = 0.0
    elements: list[JunitElement] = field(default_factory=list)
    properties: list[tuple[str, str]] = field(default_factory=list)  # record_property

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "elements": [{"tag": e.tag, "attrs": e.attrs, "text": e.text} for e in self.elements],
            "properties": self.properties,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JunitCase:
        return cls(
            float(data.get("time", 0.0)),
            [
                JunitElement(e["tag"], dict(e.get("attrs", {})), e.get("text"))
                for e in data["elements"]
            ],
            [(str(name), str(value)) for name, value in data.get("properties", [])],
        )


@dataclass
class PhaseReport:
    """A failed phase (setup, call or teardown) of a test, as pytest's terminal shows it:
    the traceback, then the report sections (captured output, and sections plugins added)."""

    when: str
    text: str
    sections: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"when": self.when, "text": self.text, "sections": self.sections}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PhaseReport:
        return cls(
            data["when"], data["text"], [(str(n), str(c)) for n, c in data.get("sections", [])]
        )


@dataclass
class TestResult:
    """One test's outcome: passed, xpassed, failed, error, skipped, xfailed, timeout, crashed
    or not run.

    ``classname``/``name``/``cases`` are what pytest's own ``--junitxml`` writes for
    the test (empty for outcomes gpusched makes up: timeouts, crashes, not run);
    ``reports`` are its failed phases, for the console.
    """

    nodeid: str
    outcome: str
    duration: float = 0.0
    message: str = ""
    classname: str = ""
    name: str = ""
    cases: list[JunitCase] = field(default_factory=list)
    reports: list[PhaseReport] = field(default_factory=list)


@dataclass
class FileResult:
    """One file's run. ``start``/``end`` are seconds since the run began."""

    path: str
    outcome: Outcome
    cards: tuple[str, ...] = ()
    start: float = 0.0
    end: float = 0.0
    returncode: int | None = None
    tests: list[TestResult] = field(default_factory=list)
    log: str | None = None
    message: str = ""
    attempts: int = 1
    swept: int = 0
    node: str = ""  # the cluster node that ran it (``--ray``); empty on one machine
    cpu: float | None = None  # cores its process tree used on average; None: not measured
    cpu_peak: float | None = None  # the most cores it used over one sampling interval

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    def counts(self) -> dict[str, int]:
        tally: dict[str, int] = {}
        for test in self.tests:
            tally[test.outcome] = tally.get(test.outcome, 0) + 1
        return tally

    def to_json(self) -> dict:
        data = asdict(self)
        for test in data["tests"]:
            del test["cases"]  # the JUnit report's copy of ``reports``
        data["outcome"] = str(self.outcome)
        data["duration"] = round(self.duration, 3)
        return data


def read_events(lines: Iterable[str]) -> tuple[list[TestResult], str | None, int | None]:
    """Tests finished, the test started but never finished, and pytest's exit status if it ended.

    Reads the plugin's stream; a torn last line (the child died mid-write) is ignored.
    """
    finished: dict[str, TestResult] = {}
    running: str | None = None
    exitstatus: int | None = None
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("event")
        if kind == "start":
            running = event["nodeid"]
        elif kind == "result":
            finished[event["nodeid"]] = _test_result(event, event["outcome"], event["duration"])
            if running == event["nodeid"]:
                running = None
        elif kind == "collecterror":  # the child's own collection of its file failed
            finished[event["nodeid"]] = _test_result(event, "error", 0.0)
        elif kind == "finish":
            exitstatus = event["exitstatus"]
    return list(finished.values()), running, exitstatus


def _test_result(event: dict[str, Any], outcome: str, duration: float) -> TestResult:
    """A streamed record as a TestResult; the JUnit and console fields are optional."""
    return TestResult(
        event["nodeid"],
        outcome,
        duration,
        event["message"],
        event.get("classname", ""),
        event.get("name", ""),
        [JunitCase.from_json(case) for case in event.get("cases", [])],
        [PhaseReport.from_json(report) for report in event.get("reports", [])],
    )


EXIT_RECOLLECTED = 71  # a child whose file needs other cards than the cache said
DEFERRED = "deferred"  # the expectation of a file collection did not import: report, never stop


def expectation(requirement: Requirement, tests: Sequence[str]) -> str:
    """What a child must find after its own collection: ``GPUS:MEMORY:TESTS_HASH``.

    The collection cache makes it (``gpusched.collection.cache``), the runner
    passes it to the child, the plugin checks it and stops with ``EXIT_RECOLLECTED``.
    """
    memory = "" if requirement.memory is None else str(requirement.memory)
    return f"{requirement.gpus}:{memory}:{tests_hash(tests)}"


def parse_expectation(text: str) -> tuple[Requirement, str]:
    """The requirement and tests hash of an ``expectation`` string; ValueError if malformed."""
    gpus, memory, tests = text.split(":")
    return Requirement(int(gpus), int(memory) if memory else None), tests


def tests_hash(tests: Sequence[str]) -> str:
    """A short hash of a file's selected test ids, in order."""
    return hashlib.sha256(json.dumps(list(tests)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Recollected:
    """What a child's own collection found where the collection cache predicted otherwise."""

    requirement: Requirement
    levels: tuple[Requirement, ...]
    tests: tuple[str, ...]


def read_recollection(lines: Iterable[str]) -> Recollected | None:
    """The child's ``collected`` event (``--gpusched-expect`` found a difference), if any."""
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "collected":
            return Recollected(
                Requirement(event["gpus"], event["memory"]),
                tuple(Requirement(gpus, memory) for gpus, memory in event["levels"]),
                tuple(event["tests"]),
            )
    return None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def judge(
    path: str,
    expected_tests: Iterable[str],
    returncode: int,
    events: Iterable[str],
    *,
    timed_out: float | None = None,
    interrupted: bool = False,
) -> FileResult:
    """The file's outcome from its exit and its event stream.

    A child that ended without pytest's own finish event crashed (signal,
    ``os._exit``, ``abort``), whatever its exit code; the test it was running
    is charged with the crash, the tests it finished keep their outcomes, and
    the tests it never reached are NOT RUN.
    """
    tests, running, exitstatus = read_events(events)
    reached = {test.nodeid for test in tests} | ({running} if running else set())
    unreached = [nodeid for nodeid in expected_tests if nodeid not in reached]
    result = FileResult(path, Outcome.PASSED, returncode=returncode, tests=tests)
    if interrupted:
        result.outcome, result.message = Outcome.INTERRUPTED, "interrupted by the user"
        blame = "not run"
    elif timed_out is not None:
        result.outcome = Outcome.TIMEOUT
        result.message = f"timed out after {timed_out:g}s" + (f" in {running}" if running else "")
        blame = "timeout"
    elif exitstatus is None:
        result.outcome = Outcome.CRASHED
        result.message = describe_exit(returncode) + (f" during {running}" if running else "")
        blame = "crashed"
    else:
        outcomes = {test.outcome for test in tests}
        if exitstatus in (0, 5) and not outcomes & {"failed", "error"}:
            result.outcome = Outcome.PASSED
        elif exitstatus == 2 and outcomes == {"error"}:  # pytest stops after collection errors
            result.outcome, result.message = Outcome.ERROR, "collection error"
        elif exitstatus in (0, 1) or outcomes & {"failed", "error"}:
            result.outcome = Outcome.FAILED
        else:
            result.outcome = Outcome.ERROR
            result.message = f"pytest exited with code {exitstatus}"
            if not tests:
                error = JunitElement("error", {"message": result.message}, result.message)
                result.tests.append(
                    TestResult(path, "error", 0.0, result.message, cases=[JunitCase(0.0, [error])])
                )
        return result
    if running:
        result.tests.append(TestResult(running, blame, 0.0, result.message))
    elif blame != "not run":
        result.tests.append(TestResult(path, blame, 0.0, result.message))
    result.tests.extend(TestResult(nodeid, "not run") for nodeid in unreached)
    return result
