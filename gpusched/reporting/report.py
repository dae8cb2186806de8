"""Reports of a run: console lines, the pytest-style summary, merged JUnit XML, JSON.

Files are written atomically (a temporary name, then rename), so an interrupted
run never leaves half a report.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from gpusched.reporting.junit import fallback_case, junit_names, xml_safe
from gpusched.results import FAILING, FileResult, JunitCase, Outcome, TestResult
from gpusched.scheduling import Job

# Test outcomes by the bucket of the last line they count in, as pytest's JUnit counts them:
# an xfailed test is skipped, an xpassed one passed (a strict xpass is reported failed).
PASSED_KINDS = ("passed", "xpassed")
FAIL_KINDS = ("failed", "error", "timeout", "crashed")
SKIPPED_KINDS = ("skipped", "xfailed")
BREAKDOWN = (*PASSED_KINDS, *FAIL_KINDS, *SKIPPED_KINDS, "not run")


def display_path(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def format_cards(cards: Sequence[str]) -> str:
    return "gpu " + ",".join(cards) if cards else "cpu"


def format_place(cards: Sequence[str], node: str = "") -> str:
    """Where a file ran: its cards, after its node's name in a cluster run (``--ray``)."""
    return f"{node} {format_cards(cards)}" if node else format_cards(cards)


def format_counts(result: FileResult) -> str:
    counts = result.counts()
    return ", ".join(f"{counts[kind]} {kind}" for kind in BREAKDOWN if counts.get(kind))


def file_line(result: FileResult) -> str:
    """One line per finished file: outcome, path, cards, duration, test counts, reason."""
    parts = [f"{result.outcome.value:<11}", display_path(result.path)]
    if result.outcome not in (Outcome.SKIPPED, Outcome.NOT_RUN, Outcome.ERROR) or result.cards:
        parts.append(f"[{format_place(result.cards, result.node)}] {result.duration:.1f}s")
    counts = format_counts(result)
    if counts:
        parts.append(f"({counts})")
    if result.message:
        parts.append(f"- {result.message}")
    if result.swept:
        parts.append(f"- killed {result.swept} process(es) the tests left behind")
    return " ".join(parts)


def heartbeat_line(running: Sequence[tuple[Job, float]]) -> str:
    """``--heartbeat``: the files still running, each with its elapsed seconds."""
    files = ", ".join(f"{display_path(job.path)} {elapsed:.1f}s" for job, elapsed in running)
    return f"gpusched: running {len(running)}: {files}"


def totals(results: Iterable[FileResult]) -> dict[str, int]:
    """Tests by outcome over all files."""
    tally: dict[str, int] = {}
    for result in results:
        for kind, count in result.counts().items():
            tally[kind] = tally.get(kind, 0) + count
    return tally


def buckets(tally: dict[str, int]) -> tuple[int, int, int]:
    """``(passed, failed, skipped)`` of the last line from tests by outcome.

    xpassed counts as passed and xfailed as skipped, as pytest's JUnit counts
    them; failed counts failures, errors, timeouts and crashes; tests never run
    count in none (the breakdown names them).
    """
    return (
        sum(tally.get(kind, 0) for kind in PASSED_KINDS),
        sum(tally.get(kind, 0) for kind in FAIL_KINDS),
        sum(tally.get(kind, 0) for kind in SKIPPED_KINDS),
    )


def breakdown_line(tally: dict[str, int]) -> str | None:
    """The line above the last: every outcome by name, or None where the last line says it all.

    Shown when a test failed in any way, xfailed, xpassed or never ran, e.g.
    ``gpusched: tests: 5 passed, 1 xpassed, 6 failed, 3 error, 2 skipped, 2 xfailed``.
    The failure kinds are always all named, so a run's failures read the same every time.
    """
    failed = buckets(tally)[1]
    if not (failed or any(tally.get(kind) for kind in ("xpassed", "xfailed", "not run"))):
        return None
    shown = [
        f"{tally.get(kind, 0)} {kind}"
        for kind in BREAKDOWN
        if tally.get(kind) or (failed and kind in FAIL_KINDS)
    ]
    return "gpusched: tests: " + ", ".join(shown)


def summary_lines(results: Sequence[FileResult], quarantined: Sequence[str] = ()) -> list[str]:
    """Files by outcome, flaky files, quarantined cards, the breakdown of tests by outcome
    (``breakdown_line``) and, last, exactly ``gpusched: P passed, F failed, S skipped``."""
    tally = totals(results)
    files: dict[str, int] = {}
    for result in results:
        files[result.outcome.value] = files.get(result.outcome.value, 0) + 1
    lines = [
        "gpusched: files: "
        + (", ".join(f"{count} {name.lower()}" for name, count in files.items()) or "none")
    ]
    flaky = [display_path(r.path) for r in results if r.outcome == Outcome.FLAKY]
    if flaky:
        lines.append("gpusched: flaky: " + ", ".join(flaky))
    if quarantined:
        lines.append("gpusched: quarantined cards: " + ", ".join(quarantined))
    breakdown = breakdown_line(tally)
    if breakdown:
        lines.append(breakdown)
    passed, failed, skipped = buckets(tally)
    lines.append(f"gpusched: {passed} passed, {failed} failed, {skipped} skipped")
    return lines


def log_tail(result: FileResult, lines: int = 40) -> list[str]:
    if not result.log:
        return []
    try:
        text = Path(result.log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _last_lines(text: str, limit: int) -> list[str]:
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= limit:
        return lines
    return [f"... ({len(lines) - limit} lines above not shown)", *lines[-limit:]]


def failure_lines(result: FileResult, text_lines: int = 200, section_lines: int = 100) -> list[str]:
    """A failing file's failed tests as pytest's terminal shows them: per failed phase, a
    header, the traceback, then each report section (captured output, and what plugins
    add, such as per-rank logs) under its own header. Long ones keep their last lines."""
    lines: list[str] = []
    for test in result.tests:
        for report in test.reports:
            head = (
                test.nodeid if report.when == "call" else f"ERROR at {report.when} of {test.nodeid}"
            )
            lines.append(f" {head} ".center(80, "_"))
            lines += _last_lines(report.text, text_lines)
            for name, content in report.sections:
                lines.append(f" {name} ".center(80, "-"))
                lines += _last_lines(content, section_lines)
    return lines


def _cases(test: TestResult) -> tuple[str, str, list[JunitCase]]:
    """A test's classname, name and testcases: the child's, else made here from its outcome."""
    if test.name:
        return test.classname, test.name, test.cases or [JunitCase(test.duration)]
    nodeid = display_path(test.nodeid) if os.path.isabs(test.nodeid) else test.nodeid
    classname, name = junit_names(nodeid.replace(os.sep, "/"))
    cases = test.cases or [fallback_case(nodeid, test.outcome, test.message, test.duration)]
    return classname, name, cases


def _add_case(suite: ET.Element, classname: str, name: str, case: JunitCase) -> None:
    element = ET.SubElement(
        suite, "testcase", classname=xml_safe(classname), name=xml_safe(name),
        time=f"{case.time:.3f}",
    )  # fmt: skip
    if case.properties:
        props = ET.SubElement(element, "properties")
        for key, value in case.properties:
            ET.SubElement(props, "property", name=xml_safe(key), value=xml_safe(value))
    for child in case.elements:
        sub = ET.SubElement(
            element, child.tag, {key: xml_safe(value) for key, value in child.attrs.items()}
        )
        if child.text is not None:
            sub.text = xml_safe(child.text)


def junit_xml(results: Sequence[FileResult]) -> str:
    """One testsuite per file, the cards and outcome as properties; each test's testcase(s)
    as pytest's own ``--junitxml`` writes them (``gpusched.reporting.junit``), timeouts
    and crashes as errors of type ``timeout``/``crashed``, tests never run as skipped.

    A suite's counts are its elements: testcases, ``failure``, ``error`` and ``skipped``.
    """
    root = ET.Element("testsuites", name="gpusched")
    grand = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for result in results:
        suite = ET.SubElement(
            root, "testsuite", name=xml_safe(display_path(result.path)),
            time=f"{result.duration:.3f}",
        )  # fmt: skip
        props = ET.SubElement(suite, "properties")
        for name, value in (
            ("cards", ",".join(result.cards)),
            ("outcome", result.outcome.value),
            ("attempts", str(result.attempts)),
            ("message", result.message),
            *((("node", result.node),) if result.node else ()),
        ):
            ET.SubElement(props, "property", name=name, value=xml_safe(value))
        for test in result.tests:
            classname, name, cases = _cases(test)
            for case in cases:
                _add_case(suite, classname, name, case)
        numbers = {
            "tests": len(suite.findall("testcase")),
            "failures": len(suite.findall("testcase/failure")),
            "errors": len(suite.findall("testcase/error")),
            "skipped": len(suite.findall("testcase/skipped")),
        }
        for key, value in numbers.items():
            suite.set(key, str(value))
            grand[key] += value
        total_time += result.duration
    for key, value in grand.items():
        root.set(key, str(value))
    root.set("time", f"{total_time:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def json_report(
    results: Sequence[FileResult],
    interrupted: bool,
    quarantined: Sequence[str],
    exit_code: int,
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The ``--json`` report; a cluster run's adds ``nodes``: each node's cards, idle ones and
    those of nodes that joined during the run included."""
    tally = totals(results)
    passed, failed, skipped = buckets(tally)
    payload = {
        "version": 1,
        "exit_code": exit_code,
        "interrupted": interrupted,
        "quarantined": list(quarantined),
        "summary": {
            "passed": passed,
            "failed": failed,
            "skipped": skipped,
            "not_run": tally.get("not run", 0),
            "by_outcome": tally,
        },
        "files": [result.to_json() for result in results],
    }
    if nodes is not None:
        payload["nodes"] = {name: {"cards": list(cards)} for name, cards in nodes.items()}
    return json.dumps(payload, indent=2) + "\n"


class ConsoleReporter:
    """Plain, line-oriented progress for logs and CI: one line per event, no control codes."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout  # read when built, not at import

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def started(self, job: Job, cards: tuple[str, ...], attempt: int) -> None:
        again = f" (attempt {attempt})" if attempt > 1 else ""
        self.say(f"{'START':<11} {display_path(job.path)} [{format_cards(cards)}]{again}")

    def finished(self, result: FileResult) -> None:
        self.say(file_line(result))

    def deselected(self, job: Job) -> None:
        self.say(f"{'DESELECTED':<11} {display_path(job.path)} (no test selected)")

    def interrupting(self, signum: int, second: bool) -> None:
        if second:
            self.say("gpusched: interrupted again: killing every running file now")
        else:
            self.say("gpusched: interrupted: stopping running files (again to kill at once)")

    def heartbeat(self, running: Sequence[tuple[Job, float]]) -> None:
        self.say(heartbeat_line(running))


def failing(results: Iterable[FileResult]) -> list[FileResult]:
    return [result for result in results if result.outcome in FAILING]
