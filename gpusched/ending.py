"""The end of every run, on one machine or across a cluster: history, reports, coverage, summary.

Both sessions (``gpusched.session``, ``gpusched.cluster_session``) hand what
their run left to ``end_run``; nothing of a run's end is written twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched import EXIT_EMPTY, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, STATE_DIR
from gpusched.atomic import atomic_write
from gpusched.collection.collect import CollectionFailed
from gpusched.history import HISTORY_FILE, observations, record_durations
from gpusched.options import UsageError
from gpusched.reporting.report import (
    ConsoleReporter,
    display_path,
    failing,
    failure_lines,
    json_report,
    junit_xml,
    log_tail,
    summary_lines,
)
from gpusched.results import FileResult, Outcome


@dataclass
class RunEnd:
    """What a run left for its end.

    ``results``: every file's final result (collection errors and skips too);
    ``ran``: those the runner produced (they have durations, for the history).
    """

    results: list[FileResult]
    ran: list[FileResult]
    rootdir: str
    interrupted: bool = False
    quarantined: list[str] = field(default_factory=list)
    failure: CollectionFailed | None = None
    collected: bool = True  # the collection ended (False: stopped by -x or an interrupt)
    cards: Sequence[str] = ()  # this machine's cards, for the timeline
    nodes: Mapping[str, Sequence[str]] | None = None  # a cluster's nodes and their cards
    lost: Sequence[tuple[str, str]] = ()  # a cluster's lost nodes, and why
    coverage: Path | None = None  # where the files measured into (``gpusched.coverage.data``)


def end_run(end: RunEnd, settings: dict[str, Any], reporter: ConsoleReporter) -> int:
    """Record the durations, write the timeline, report; the run's exit code."""
    warning = record_durations(STATE_DIR / HISTORY_FILE, observations(end.ran, end.rootdir))
    if warning:
        reporter.say(f"gpusched: warning: {warning}")
    if settings.get("timeline"):
        from gpusched.reporting.timeline import timeline_html

        atomic_write(settings["timeline"], timeline_html(end.results, end.cards, nodes=end.nodes))
    for name, why in end.lost:
        reporter.say(f"gpusched: node {name} was lost: {why}")
    failure = end.failure
    if failure is not None:
        if failure.exit_code == EXIT_USAGE and not end.ran:
            raise UsageError(str(failure)) from None  # the command line prints it, once
        reporter.say(f"gpusched: {failure}")
        if not end.results:
            return failure.exit_code
        finish(end, settings, reporter)
        return failure.exit_code
    if end.interrupted and not end.collected:
        reporter.say("gpusched: interrupted during collection")
    return finish(end, settings, reporter)


def exit_code(results: Sequence[FileResult], interrupted: bool) -> int:
    if interrupted:
        return EXIT_INTERRUPTED
    if failing(results):
        return EXIT_FAILED
    if not results:
        return EXIT_EMPTY
    return EXIT_OK


def failing_file_lines(result: FileResult) -> list[str]:
    """What the console shows of a failing file: its failed tests as pytest's terminal shows
    them, with every report section (``failure_lines``), then the end of the file's log
    where the tests alone cannot explain the outcome (a timeout, a crash, an error of
    pytest itself or of collection, a failure without a failed test)."""
    lines = failure_lines(result)
    if not lines or result.outcome != Outcome.FAILED:
        lines += log_tail(result)
    if not lines:
        return []
    return [f"{'_' * 20} {display_path(result.path)} ({result.outcome.value}) {'_' * 20}", *lines]


def finish(end: RunEnd, settings: dict[str, Any], reporter: ConsoleReporter) -> int:
    """Failures' log tails, the coverage report, JUnit and JSON reports, the summary lines;
    the exit code (``--cov-fail-under`` fails a run whose tests passed, as under pytest)."""
    results = end.results
    code = exit_code(results, end.interrupted)
    for result in failing(results):
        for line in failing_file_lines(result):
            reporter.say(line)
    if end.coverage is not None:
        from gpusched.coverage.combine import combine_and_report
        from gpusched.coverage.data import attempts

        verdict = combine_and_report(
            attempts(end.coverage, "*" if end.nodes is not None else ""),
            root=end.rootdir,
            tests_failed=bool(failing(results)),
            display=display_path,
        )
        for line in verdict.lines:
            reporter.say(line)
        if verdict.failed_under and code in (EXIT_OK, EXIT_EMPTY):
            code = EXIT_FAILED
    if settings.get("junitxml"):
        atomic_write(settings["junitxml"], junit_xml(results))
    if settings.get("json"):
        atomic_write(
            settings["json"],
            json_report(results, end.interrupted, end.quarantined, code, end.nodes),
        )
    for line in summary_lines(results, end.quarantined):
        reporter.say(line)
    return code
