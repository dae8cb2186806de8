"""The session driver: options -> inventory -> collection -> jobs -> runner -> reports.

``run`` and ``plan`` share everything up to the jobs; ``run`` then hands them
to the asyncio runner, ``plan`` to the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched import (
    EXIT_EMPTY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    STATE_DIR,
)
from gpusched.atomic import atomic_write
from gpusched.collection.cache import (
    CACHE_FILE,
    CachedFile,
    context_key,
    load_cache,
    relative_key,
    remembered,
    save_cache,
)
from gpusched.collection.collect import Collection, CollectionFailed, collect
from gpusched.execution.childenv import PortPool, local_tmp_root, read_mounts
from gpusched.execution.forkclient import (
    EarlyServer,
    ForkServer,
    ServerSpec,
    new_run_id,
    server_spec,
    start_server,
)
from gpusched.execution.preload import guess_rootdir
from gpusched.execution.release import release_check
from gpusched.execution.runner import Child, RunConfig, Runner, start_early, stop_early
from gpusched.history import (
    HISTORY_FILE,
    expected_durations,
    history_key,
    load_history,
    observations,
    record_durations,
)
from gpusched.inventory import Card, InventoryError, discover, parse_simulate_spec
from gpusched.options import UsageError, check_paths
from gpusched.reporting.report import (
    ConsoleReporter,
    display_path,
    failing,
    format_cards,
    json_report,
    junit_xml,
    log_tail,
    summary_lines,
)
from gpusched.requirements import Requirement, format_memory
from gpusched.results import FileResult, Outcome, TestResult, expectation
from gpusched.scheduling import Job, largest_fitting, simulate
from gpusched.scheduling.earlystart import early_picks


@dataclass
class Prepared:
    """What ``run`` and ``plan`` both need before scheduling."""

    cards: list[Card]
    collection: Collection
    jobs: list[Job]
    selection: list[str]
    warnings: list[str] = field(default_factory=list)
    known: int = 0  # files whose expected duration comes from the history
    expect: dict[str, str] = field(default_factory=dict)  # cached files: what their child checks
    cache: tuple[Path, str] | None = None  # the collection cache's path and context key


def selection_args(settings: dict[str, Any]) -> list[str]:
    args = []
    if settings.get("markexpr"):
        args += ["-m", settings["markexpr"]]
    if settings.get("keyword"):
        args += ["-k", settings["keyword"]]
    return args


def runnable_requirement(
    requirement: Requirement, levels: Sequence[Requirement], cards: Sequence[Card]
) -> Requirement:
    """A file's requirement, lowered to the largest of its tests' that fits the inventory."""
    return largest_fitting((requirement,), cards) or largest_fitting(levels, cards) or requirement


def collection_cache(
    paths: Sequence[str], settings: dict[str, Any], args: Sequence[str]
) -> tuple[Path, str] | None:
    """The collection cache's path and context key, or None where it is off.

    Off with ``--collect-cache off`` and when a path names tests inside a file
    (``file::test``): the cache describes whole files.
    """
    if not settings.get("collect_cache", True) or any("::" in path for path in paths):
        return None
    return STATE_DIR / CACHE_FILE, context_key(args, os.environ.get("PYTEST_ADDOPTS"))


def remember_collection(path: Path, collection: Collection) -> None:
    """Store what this collection found, for the next run (``gpusched.collection.cache``)."""
    keys = collection.keys
    files = [
        (entry.path, CachedFile(keys[entry.path], entry.requirement, entry.tests, entry.levels))
        for entry in collection.files
        if entry.path in keys
    ]
    listed = {entry.path for entry in collection.files}
    empty = [(p, key) for p, key in keys.items() if p not in listed]
    rootdir = Path(collection.rootdir)
    try:
        save_cache(path, remembered(load_cache(path), files, empty, rootdir), rootdir)
    except OSError:
        pass  # only a cache: the next run collects everything again


def forget_collected(path: Path, stale: Sequence[str], rootdir: str) -> None:
    """Drop the cache entries of files whose child found them different from the cache."""
    if not stale:
        return
    entries = load_cache(path)
    for file in stale:
        entries.pop(relative_key(file, rootdir) or "", None)
    try:
        save_cache(path, entries, Path(rootdir))
    except OSError:
        pass


def prepare(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    server: ForkServer | None = None,
    on_inventory: Callable[[list[Card]], None] | None = None,
) -> Prepared:
    """Inventory, collection (in a child of ``server`` if given) and jobs.

    ``on_inventory`` hears the cards before collection starts (early starts).

    Raises UsageError or CollectionFailed.
    """
    check_paths(paths)
    try:
        simulated = (
            parse_simulate_spec(settings["simulate_gpus"]) if settings["simulate_gpus"] else None
        )
        cards = discover(simulated, settings["gpus"])
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    if on_inventory is not None:
        on_inventory(cards)
    selection = selection_args(settings)
    args = [*selection, *pytest_args]
    cache = collection_cache(paths, settings, args)
    collection = collect(paths, args, settings["collect_timeout"], server, cache)
    if cache is not None:
        remember_collection(cache[0], collection)
    history, warning = load_history(STATE_DIR / HISTORY_FILE)
    keys = [history_key(entry.path, collection.rootdir) for entry in collection.files]
    expected = expected_durations(history, keys)
    jobs = [
        Job(
            index,
            entry.path,
            runnable_requirement(entry.requirement, entry.levels, cards),
            expected[key],
        )
        for index, (entry, key) in enumerate(zip(collection.files, keys, strict=True))
    ]
    known = sum(1 for key in keys if key in history)
    expect = {
        entry.path: expectation(entry.requirement, entry.tests)
        for entry in collection.files
        if entry.cached
    }
    return Prepared(
        cards, collection, jobs, selection, [warning] if warning else [], known, expect, cache
    )


def collection_results(collection: Collection) -> list[FileResult]:
    """Files that never reach the runner: collection errors and whole-module skips."""
    results = [
        FileResult(
            error.path,
            Outcome.ERROR,
            message="collection error",
            tests=[TestResult(error.nodeid, "error", 0.0, error.message)],
        )
        for error in collection.errors
    ]
    results += [
        FileResult(
            skip.path,
            Outcome.SKIPPED,
            message=skip.message,
            tests=[TestResult(skip.nodeid, "skipped", 0.0, skip.message)],
        )
        for skip in collection.skipped
    ]
    return results


def child_args(
    paths: Sequence[str], settings: dict[str, Any], pytest_args: Sequence[str]
) -> tuple[str, ...]:
    args = [*selection_args(settings), *pytest_args]
    if settings.get("per_test_timeout"):
        args.append(f"--timeout={settings['per_test_timeout']:g}")
    return tuple(args)


def exit_code(results: Sequence[FileResult], interrupted: bool) -> int:
    if interrupted:
        return EXIT_INTERRUPTED
    if failing(results):
        return EXIT_FAILED
    if not results:
        return EXIT_EMPTY
    return EXIT_OK


@contextlib.contextmanager
def fork_server(
    paths: Sequence[str],
    settings: dict[str, Any],
    run_id: str,
    reporter: ConsoleReporter,
    early: EarlyServer | None = None,
) -> Iterator[ForkServer | None]:
    """The run's fork server, or None (``--fork-server off``, or unsafe: said once, here).

    ``early`` is the server the command line already started for this run
    (``start_early_server``). Closed, with anything left of it, when the block ends.
    """
    if not settings.get("fork_server", True):
        yield None
        return
    fresh = "; every file starts a fresh python -m pytest"
    if early is not None:
        early.taken = True
        spec: ServerSpec | str = early.spec
    else:
        spec = server_spec(paths, settings, run_id, STATE_DIR / "logs")
    if isinstance(spec, str):
        reporter.say(f"gpusched: fork server off: {spec}{fresh}")
        yield None
        return
    startup = start_server(spec, early.server if early is not None else None)
    for note in startup.notes:
        reporter.say(f"gpusched: {note}")
    if startup.server is None:
        reporter.say(f"gpusched: fork server off for this run: {startup.reason}{fresh}")
        yield None
        return
    try:
        yield startup.server
    finally:
        startup.server.close()


def run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
    early: EarlyServer | None = None,
) -> int:
    """``gpusched run``: the whole main path. Returns the exit code.

    ``early``: the fork server the command line started (``start_early_server``).
    """
    reporter = reporter or ConsoleReporter()
    if settings.get("per_test_timeout"):
        import importlib.util

        if importlib.util.find_spec("pytest_timeout") is None:
            raise UsageError("--per-test-timeout needs pytest-timeout (pip install pytest-timeout)")
    run_id = early.spec.run_id if early is not None else new_run_id()
    try:
        with fork_server(paths, settings, run_id, reporter, early) as server:
            return _run(paths, settings, pytest_args, reporter, server, run_id)
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted during collection")
        return _finish([], True, [], settings, reporter)


def _run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    run_id: str,
) -> int:
    t0 = time.monotonic()
    tmp_root, tmp_warning = local_tmp_root(os.environ.get("TMPDIR"), read_mounts())
    log_dir = STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="gpusched-run-"))
    config = RunConfig(
        pytest_args=child_args(paths, settings, pytest_args),
        timeout=settings["timeout"],
        kill_grace=settings["kill_grace"],
        simulated=bool(settings["simulate_gpus"]),
        log_dir=log_dir,
        work_dir=work_dir,
        tmp_root=tmp_root,
        run_id=run_id,
        reruns=settings["reruns"],
        exitfirst=settings["exitfirst"],
        rootdir=str(guess_rootdir(paths, Path.cwd())),
        heartbeat=settings["heartbeat"],
        prestart=settings["prestart"],
    )
    early: dict[str, Child] = {}

    def start_early_files(cards: list[Card]) -> None:
        """No card to wait for: the longest known files start now, beside collection."""
        if server is None or cards:
            return
        history, _ = load_history(STATE_DIR / HISTORY_FILE)
        rootdir = Path(config.rootdir)
        ports = PortPool()
        for n, path in enumerate(early_picks(history, rootdir, paths, settings["cpu_slots"])):
            child = start_early(server, config, ports, path, f"e{n}-1")
            if child is not None:
                early[path] = child

    try:
        return _run_prepared(
            paths, settings, pytest_args, reporter, server, config, early, start_early_files,
            tmp_warning, t0,
        )  # fmt: skip
    finally:
        for child in early.values():
            if server is not None:
                stop_early(child, server)
        shutil.rmtree(work_dir, ignore_errors=True)


def _run_prepared(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    config: RunConfig,
    early: dict[str, Any],
    on_inventory: Callable[[list[Card]], None],
    tmp_warning: str | None,
    t0: float,
) -> int:
    try:
        prepared = prepare(paths, settings, pytest_args, server, on_inventory)
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted during collection")
        return _finish([], True, [], settings, reporter)
    except CollectionFailed as exc:
        if exc.exit_code == EXIT_USAGE:
            raise UsageError(str(exc)) from None  # the command line prints it, once
        reporter.say(f"gpusched: {exc}")
        return exc.exit_code
    for warning in prepared.warnings:
        reporter.say(f"gpusched: warning: {warning}")
    results = collection_results(prepared.collection)
    for result in results:
        reporter.finished(result)
    collected = {entry.path for entry in prepared.collection.files}
    adopted = {path: early.pop(path) for path in list(early) if path in collected}
    if not prepared.jobs:
        if not results:
            reporter.say("gpusched: no tests collected")
        return _finish(results, False, [], settings, reporter)
    cards = prepared.cards
    reporter.say(
        f"gpusched: {len(prepared.jobs)} files on "
        + (
            f"{len(cards)} {'simulated ' if settings['simulate_gpus'] else ''}cards"
            if cards
            else "no GPUs"
        )
        + f" and {settings['cpu_slots']} CPU slots"
        + (f" ({len(adopted)} started during collection)" if adopted else "")
    )
    if tmp_warning:
        reporter.say(f"gpusched: warning: {tmp_warning}")
    from gpusched.scheduling import Packer

    tests = {entry.path: entry.tests for entry in prepared.collection.files}
    config = dataclasses.replace(config, rootdir=prepared.collection.rootdir)
    live = live_reporter(reporter, cards, settings["cpu_slots"], len(prepared.jobs))
    if live is not None:
        config = dataclasses.replace(config, heartbeat=None)  # the live table shows elapsed times
    real_cards = bool(cards) and not settings["simulate_gpus"]
    with (
        live or contextlib.nullcontext(),
        release_check(
            real_cards,
            settings["gpu_release_timeout"],
            settings["gpu_release_memory"],
            warn=(live or reporter).say,
        ) as releaser,
    ):
        runner = Runner(
            config,
            Packer(cards, settings["cpu_slots"]),
            tests,
            live or reporter,
            releaser,
            forkserver=server,
            t0=t0 if adopted else None,
            expect=prepared.expect,
            refit=lambda requirement, levels: runnable_requirement(requirement, levels, cards),
        )
        report = asyncio.run(runner.run(prepared.jobs, adopted))
    if prepared.cache is not None:
        forget_collected(prepared.cache[0], sorted(runner.recollected), prepared.collection.rootdir)
    if runner.forkserver_lost:
        reporter.say(
            f"gpusched: warning: {runner.forkserver_lost}; later files started fresh processes"
        )
    warning = record_durations(
        STATE_DIR / HISTORY_FILE, observations(report.results, prepared.collection.rootdir)
    )
    if warning:
        reporter.say(f"gpusched: warning: {warning}")
    if settings.get("timeline"):
        from gpusched.reporting.timeline import timeline_html

        atomic_write(
            settings["timeline"], timeline_html(results + report.results, [c.id for c in cards])
        )
    return _finish(
        results + report.results, report.interrupted, report.quarantined, settings, reporter
    )


def live_reporter(
    reporter: ConsoleReporter, cards: Sequence[Card], cpu_slots: int, total: int
) -> Any:
    """A live view (``gpusched.reporting.live``) when ``reporter`` writes to an interactive terminal
    outside CI, else None (the plain reporter goes on)."""
    isatty = getattr(reporter.out, "isatty", None)
    if type(reporter) is not ConsoleReporter or not (isatty and isatty()):
        return None  # decided before importing rich (0.2 s of every run's start-up)
    from gpusched.reporting.live import LiveReporter, wants_live

    if not wants_live(reporter.out, os.environ):
        return None
    from rich.console import Console

    return LiveReporter([c.id for c in cards], cpu_slots, total, Console(file=reporter.out))


def _finish(
    results: list[FileResult],
    interrupted: bool,
    quarantined: list[str],
    settings: dict[str, Any],
    reporter: ConsoleReporter,
) -> int:
    code = exit_code(results, interrupted)
    for result in failing(results):
        tail = log_tail(result)
        if tail:
            reporter.say(
                f"{'_' * 20} {display_path(result.path)} ({result.outcome.value}) {'_' * 20}"
            )
            for line in tail:
                reporter.say(line)
    if settings.get("junitxml"):
        atomic_write(settings["junitxml"], junit_xml(results))
    if settings.get("json"):
        atomic_write(settings["json"], json_report(results, interrupted, quarantined, code))
    for line in summary_lines(results, quarantined):
        reporter.say(line)
    return code


def plan(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
) -> int:
    """``gpusched plan``: requirements and the predicted schedule; runs nothing."""
    reporter = reporter or ConsoleReporter()
    try:
        prepared = prepare(paths, settings, pytest_args)
    except CollectionFailed as exc:
        if exc.exit_code == EXIT_USAGE:
            raise UsageError(str(exc)) from None
        reporter.say(f"gpusched: {exc}")
        return exc.exit_code
    for warning in prepared.warnings:
        reporter.say(f"gpusched: warning: {warning}")
    for error in prepared.collection.errors:
        reporter.say(f"ERROR       {display_path(error.path)} - collection error")
    if not prepared.jobs:
        reporter.say("gpusched: no tests collected")
        return EXIT_FAILED if prepared.collection.errors else EXIT_EMPTY
    reporter.say(f"{'file':<60} {'needs':<16} {'tests':>5} {'expected':>9}")
    tests = {entry.path: len(entry.tests) for entry in prepared.collection.files}
    for job in prepared.jobs:
        reporter.say(
            f"{display_path(job.path):<60} {job.requirement.describe():<16} "
            f"{tests[job.path]:>5} {job.expected:>8.1f}s"
        )
    runs, skipped = simulate(prepared.cards, prepared.jobs, settings["cpu_slots"])
    cards = ", ".join(
        f"{c.id}({format_memory(c.memory)})" if c.memory else c.id for c in prepared.cards
    )
    reporter.say(
        f"\npredicted schedule on cards [{cards or 'none'}], {settings['cpu_slots']} CPU slots:"
    )
    for planned in sorted(runs, key=lambda r: (r.start, r.job.id)):
        reporter.say(
            f"  {planned.start:8.1f}s -> {planned.end:8.1f}s  [{format_cards(tuple(c.id for c in planned.cards))}]"
            f"  {display_path(planned.job.path)}"
        )
    for job, reason in skipped:
        reporter.say(f"  SKIPPED  {display_path(job.path)} - {reason}")
    makespan = max((r.end for r in runs), default=0.0)
    reporter.say(
        f"gpusched: expected durations of {prepared.known} of {len(prepared.jobs)} files "
        f"from {STATE_DIR / HISTORY_FILE}"
        + (", the others get their mean" if prepared.known < len(prepared.jobs) else "")
    )
    eta = time.strftime("%H:%M:%S", time.localtime(time.time() + makespan))
    reporter.say(
        f"gpusched: predicted makespan {makespan:.1f}s for {len(runs)} files (ETA {eta} if started now)"
    )
    return EXIT_FAILED if prepared.collection.errors else EXIT_OK
