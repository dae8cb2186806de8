"""Reports of a run: console lines, the pytest-style summary, merged JUnit XML, JSON.

Files are written atomically (a temporary name, then rename), so an interrupted
run never leaves half a report.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from gpusched.results import FAILING, FileResult, Outcome
from gpusched.scheduling import Job

FAIL_KINDS = ("failed", "error", "timeout", "crashed")


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
    order = ("passed", "failed", "error", "timeout", "crashed", "skipped", "not run")
    return ", ".join(f"{counts[kind]} {kind}" for kind in order if counts.get(kind))


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
    tally: dict[str, int] = {}
    for result in results:
        for kind, count in result.counts().items():
            tally[kind] = tally.get(kind, 0) + count
    return tally


def summary_lines(results: Sequence[FileResult], quarantined: Sequence[str] = ()) -> list[str]:
    """The breakdown line(s) and, last, exactly ``gpusched: P passed, F failed, S skipped``."""
    tally = totals(results)
    files: dict[str, int] = {}
    for result in results:
        files[result.outcome.value] = files.get(result.outcome.value, 0) + 1
    lines = [
        "gpusched: files: "
        + (", ".join(f"{count} {name.lower()}" for name, count in files.items()) or "none")
    ]
    failed = sum(tally.get(kind, 0) for kind in FAIL_KINDS)
    if failed or tally.get("not run"):
        detail = [f"{tally.get(kind, 0)} {kind}" for kind in FAIL_KINDS]
        if tally.get("not run"):
            detail.append(f"{tally['not run']} not run")
        lines.append("gpusched: failures: " + ", ".join(detail))
    flaky = [display_path(r.path) for r in results if r.outcome == Outcome.FLAKY]
    if flaky:
        lines.append("gpusched: flaky: " + ", ".join(flaky))
    if quarantined:
        lines.append("gpusched: quarantined cards: " + ", ".join(quarantined))
    lines.append(
        f"gpusched: {tally.get('passed', 0)} passed, {failed} failed, {tally.get('skipped', 0)} skipped"
    )
    return lines


def log_tail(result: FileResult, lines: int = 40) -> list[str]:
    if not result.log:
        return []
    try:
        text = Path(result.log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _split_nodeid(nodeid: str) -> tuple[str, str]:
    head, _, name = nodeid.rpartition("::")
    if not head:
        return nodeid.removesuffix(".py").replace("/", "."), nodeid
    return head.replace(".py", "").replace("/", ".").replace("::", "."), name


def junit_xml(results: Sequence[FileResult]) -> str:
    """One testsuite per file, the cards and outcome as properties, timeouts and crashes as errors."""
    root = ET.Element("testsuites", name="gpusched")
    grand = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for result in results:
        counts = result.counts()
        numbers = {
            "tests": len(result.tests),
            "failures": counts.get("failed", 0),
            "errors": sum(counts.get(k, 0) for k in ("error", "timeout", "crashed")),
            "skipped": counts.get("skipped", 0) + counts.get("not run", 0),
        }
        suite = ET.SubElement(
            root,
            "testsuite",
            name=display_path(result.path),
            time=f"{result.duration:.3f}",
            **{key: str(value) for key, value in numbers.items()},
        )
        props = ET.SubElement(suite, "properties")
        for name, value in (
            ("cards", ",".join(result.cards)),
            ("outcome", result.outcome.value),
            ("attempts", str(result.attempts)),
            ("message", result.message),
            *((("node", result.node),) if result.node else ()),
        ):
            ET.SubElement(props, "property", name=name, value=value)
        for test in result.tests:
            classname, name = _split_nodeid(test.nodeid)
            case = ET.SubElement(
                suite, "testcase", classname=classname, name=name, time=f"{test.duration:.3f}"
            )
            first_line = (
                test.message.strip().splitlines()[-1] if test.message.strip() else test.outcome
            )
            if test.outcome == "failed":
                ET.SubElement(case, "failure", message=first_line[:500]).text = test.message
            elif test.outcome in ("error", "timeout", "crashed"):
                ET.SubElement(
                    case, "error", message=f"{test.outcome}: {first_line[:500]}", type=test.outcome
                ).text = test.message
            elif test.outcome in ("skipped", "not run"):
                ET.SubElement(case, "skipped", message=test.message or test.outcome)
        for key in grand:
            grand[key] += numbers[key]
        total_time += result.duration
    for key, value in grand.items():
        root.set(key, str(value))
    root.set("time", f"{total_time:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def json_report(
    results: Sequence[FileResult], interrupted: bool, quarantined: Sequence[str], exit_code: int
) -> str:
    tally = totals(results)
    payload = {
        "version": 1,
        "exit_code": exit_code,
        "interrupted": interrupted,
        "quarantined": list(quarantined),
        "summary": {
            "passed": tally.get("passed", 0),
            "failed": sum(tally.get(kind, 0) for kind in FAIL_KINDS),
            "skipped": tally.get("skipped", 0),
            "not_run": tally.get("not run", 0),
            "by_outcome": tally,
        },
        "files": [result.to_json() for result in results],
    }
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
