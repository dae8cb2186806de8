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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched import (
    EXIT_EMPTY,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    STATE_DIR,
)
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
from gpusched.collection.stream import collect_streaming
from gpusched.coverage.request import coverage_requested
from gpusched.ending import RunEnd, end_run, finish
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
from gpusched.feed import Feeder, error_result, skip_result
from gpusched.history import (
    HISTORY_FILE,
    Entry,
    expected_durations,
    history_key,
    load_durations,
    measured_cpu,
)
from gpusched.inventory import Card, InventoryError, discover, parse_simulate_spec
from gpusched.options import UsageError, check_paths
from gpusched.reporting.report import (
    ConsoleReporter,
    display_path,
    format_cards,
)
from gpusched.requirements import Requirement, format_memory
from gpusched.results import FileResult, Recollected, expectation
from gpusched.scheduling import Job, largest_fitting, simulate
from gpusched.scheduling.earlystart import early_picks
from gpusched.scheduling.packing import UNMEASURED_CPU_FILE, UNMEASURED_GPU_FILE


@dataclass
class Prepared:
    """What ``run`` and ``plan`` both need before scheduling."""

    cards: list[Card]
    collection: Collection
    jobs: list[Job]
    selection: list[str]
    warnings: list[str] = field(default_factory=list)
    known: int = 0  # files whose expected duration comes from the history
    entries: dict[str, Entry] = field(default_factory=dict)  # path -> its history, if it has one
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


def remember_collection(
    path: Path, collection: Collection, found: Mapping[str, Recollected] | None = None
) -> None:
    """Store what this collection found, for the next run (``gpusched.collection.cache``).

    ``found``: what the children of deferred files collected (the collection did not).
    """
    keys = collection.keys
    found = found or {}
    files = [
        (entry.path, CachedFile(keys[entry.path], entry.requirement, entry.tests, entry.levels))
        for entry in collection.files
        if entry.path in keys and not entry.deferred
    ]
    files += [
        (entry.path, CachedFile(keys[entry.path], *_found_entry(found[entry.path])))
        for entry in collection.files
        if entry.path in keys and entry.deferred and entry.path in found
    ]
    listed = {entry.path for entry in collection.files}
    empty = [(p, key) for p, key in keys.items() if p not in listed]
    rootdir = Path(collection.rootdir)
    try:
        save_cache(path, remembered(load_cache(path), files, empty, rootdir), rootdir)
    except OSError:
        pass  # only a cache: the next run collects everything again


def _found_entry(
    found: Recollected,
) -> tuple[Requirement, tuple[str, ...], tuple[Requirement, ...]]:
    return found.requirement, found.tests, found.levels


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
) -> Prepared:
    """Inventory, collection (in a child of ``server`` if given) and jobs.

    Raises UsageError or CollectionFailed.
    """
    check_paths(paths)
    cards = inventory(settings)
    selection = selection_args(settings)
    args = [*selection, *pytest_args]
    cache = collection_cache(paths, settings, args)
    measures = coverage_requested(paths, pytest_args, os.environ, Path.cwd())
    collection = collect(
        paths, [*args, *collection_no_cov(measures)], settings["collect_timeout"], server, cache
    )
    if cache is not None:
        remember_collection(cache[0], collection)
    history, warning = load_durations(STATE_DIR / HISTORY_FILE, settings["durations_seed"])
    keys = [history_key(entry.path, collection.rootdir) for entry in collection.files]
    expected = expected_durations(history, keys)
    cpu = measured_cpu(history, keys)
    jobs = [
        Job(
            index,
            entry.path,
            runnable_requirement(entry.requirement, entry.levels, cards),
            expected[key],
            cpu[key],
        )
        for index, (entry, key) in enumerate(zip(collection.files, keys, strict=True))
    ]
    known = sum(1 for key in keys if key in history)
    expect = {
        entry.path: expectation(entry.requirement, entry.tests)
        for entry in collection.files
        if entry.cached
    }
    entries = {
        entry.path: history[key]
        for entry, key in zip(collection.files, keys, strict=True)
        if key in history
    }
    return Prepared(
        cards,
        collection,
        jobs,
        selection,
        [warning] if warning else [],
        known,
        entries,
        expect,
        cache,
    )


def collection_no_cov(measures: bool) -> list[str]:
    """What keeps pytest-cov out of the collection process of a measuring run: its imports are
    measured again by each file's own process, and its data would land in the user's tree."""
    return ["--no-cov"] if measures else []


def collection_results(collection: Collection) -> list[FileResult]:
    """Files that never reach the runner: collection errors and whole-module skips."""
    return [error_result(error) for error in collection.errors] + [
        skip_result(skip) for skip in collection.skipped
    ]


def child_args(
    paths: Sequence[str], settings: dict[str, Any], pytest_args: Sequence[str]
) -> tuple[str, ...]:
    args = [*selection_args(settings), *pytest_args]
    if settings.get("per_test_timeout"):
        args.append(f"--timeout={settings['per_test_timeout']:g}")
    return tuple(args)


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


def check_per_test_timeout(settings: dict[str, Any]) -> None:
    """``--per-test-timeout`` needs pytest-timeout in every child: UsageError if it is missing."""
    if settings.get("per_test_timeout"):
        import importlib.util

        if importlib.util.find_spec("pytest_timeout") is None:
            raise UsageError("--per-test-timeout needs pytest-timeout (pip install pytest-timeout)")


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
    check_per_test_timeout(settings)
    run_id = early.spec.run_id if early is not None else new_run_id()
    try:
        with fork_server(paths, settings, run_id, reporter, early) as server:
            return _run(paths, settings, pytest_args, reporter, server, run_id)
    except KeyboardInterrupt:
        reporter.say("gpusched: interrupted during collection")
        return finish(RunEnd([], [], ".", interrupted=True), settings, reporter)


def _run(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    run_id: str,
) -> int:
    t0 = time.monotonic()
    check_paths(paths)
    cards = inventory(settings)
    tmp_root, tmp_warning = local_tmp_root(os.environ.get("TMPDIR"), read_mounts())
    log_dir = STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    measures = coverage_requested(paths, pytest_args, os.environ, Path.cwd())
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
        coverage=work_dir / "coverage" if measures else None,
    )
    history, history_warning = load_durations(STATE_DIR / HISTORY_FILE, settings["durations_seed"])
    for warning in (history_warning, tmp_warning):
        if warning:
            reporter.say(f"gpusched: warning: {warning}")
    early: dict[str, Child] = {}
    try:
        if server is not None and not cards:
            # No card to wait for: the longest known files start now, before collection.
            ports = PortPool()
            picks = early_picks(history, Path(config.rootdir), paths, settings["cpu_slots"])
            for n, path in enumerate(picks):
                child = start_early(server, config, ports, path, f"e{n}-1")
                if child is not None:
                    early[path] = child
        return _run_streaming(
            paths, settings, pytest_args, reporter, server, config, cards, history, early, t0
        )
    finally:
        for child in early.values():
            if server is not None:
                stop_early(child, server)
        shutil.rmtree(work_dir, ignore_errors=True)


def inventory(settings: dict[str, Any]) -> list[Card]:
    """The cards this run may use (``--gpus``, ``--simulate-gpus``); UsageError if malformed."""
    try:
        simulated = (
            parse_simulate_spec(settings["simulate_gpus"]) if settings["simulate_gpus"] else None
        )
        return discover(simulated, settings["gpus"])
    except InventoryError as exc:
        raise UsageError(str(exc)) from None


def header(files: int, cards: Sequence[Card], settings: dict[str, Any], early: int) -> str:
    """The line that says what the run has, once collection is done."""
    where = (
        f"{len(cards)} {'simulated ' if settings['simulate_gpus'] else ''}cards"
        if cards
        else "no GPUs"
    )
    before = f" ({early} started before collection)" if early else ""
    return f"gpusched: {files} files on {where} and {settings['cpu_slots']} CPU slots{before}"


def _run_streaming(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
    server: ForkServer | None,
    config: RunConfig,
    cards: list[Card],
    history: dict[str, Any],
    early: dict[str, Child],
    t0: float,
) -> int:
    """Collect and run at once: each file starts as soon as it is collected (``gpusched.feed``).

    On a machine without cards every file runs on a CPU slot whatever it needs
    (GPU tests skip inside it), so the collection need not import a file to
    place it: files the collection cache does not know are deferred, and each
    one's own run is its only collection (what it finds goes into the cache).
    Without that, a first run imports every module twice. With cards, a file
    must be collected before it can be placed on the right ones.
    """
    selection = selection_args(settings)
    cache = collection_cache(paths, settings, [*selection, *pytest_args])
    live = live_reporter(reporter, cards, settings["cpu_slots"], 0, collecting=True)
    if live is not None:
        config = dataclasses.replace(config, heartbeat=None)  # the live table shows elapsed times
    out = live or reporter
    real_cards = bool(cards) and not settings["simulate_gpus"]
    from gpusched.scheduling import Packer

    packer = Packer(cards, settings["cpu_slots"])
    # While collection runs it keeps one core (it is every later file's critical path);
    # early starts hold the slots they already run on until they are adopted.
    collector = 1 if settings["cpu_slots"] > 1 else 0
    packer.reserve_cpu(len(early) + collector)
    with (
        live or contextlib.nullcontext(),
        release_check(
            real_cards,
            settings["gpu_release_timeout"],
            settings["gpu_release_memory"],
            warn=out.say,
        ) as releaser,
    ):
        runner = Runner(
            config,
            packer,
            {},
            out,
            releaser,
            forkserver=server,
            t0=t0,
            refit=lambda requirement, levels: runnable_requirement(requirement, levels, cards),
            open_input=True,
        )
        feeder = Feeder(
            runner,
            runner.refit,
            history,
            out.finished,
            early,
            server,
            config.rootdir,
            grow=live.grow if live is not None else None,
        )

        def collected() -> None:
            if collector:
                runner.release_reserved()
            if live is not None:
                live.collection_done()
            if feeder.off:
                out.say(f"gpusched: files start once collection is done: {feeder.off}")
            out.say(header(len(feeder.jobs), cards, settings, feeder.started_early))

        feeder.collected = collected
        collection, failure = asyncio.run(
            _collect_and_run(
                paths,
                [*selection, *pytest_args, *collection_no_cov(config.coverage is not None)],
                settings,
                server,
                cache,
                runner,
                feeder,
                defer=cache is not None and not cards,
            )  # fmt: skip
        )
    results = feeder.results
    report = runner.report
    if collection is not None and cache is not None:
        remember_collection(cache[0], collection, runner.found)
    if collection is not None and not results and not report.results and failure is None:
        reporter.say("gpusched: no tests collected")
    if collection is not None and cache is not None:
        forget_collected(cache[0], sorted(runner.recollected), feeder.rootdir)
    if runner.forkserver_lost:
        reporter.say(
            f"gpusched: warning: {runner.forkserver_lost}; later files started fresh processes"
        )
    return end_run(
        RunEnd(
            results + report.results,
            report.results,
            feeder.rootdir,
            report.interrupted,
            report.quarantined,
            failure,
            collected=collection is not None,
            cards=[c.id for c in cards],
            coverage=config.coverage,
        ),
        settings,
        reporter,
    )


async def _collect_and_run(
    paths: Sequence[str],
    args: Sequence[str],
    settings: dict[str, Any],
    server: ForkServer | None,
    cache: tuple[Path, str] | None,
    runner: Runner,
    feeder: Feeder,
    defer: bool,
) -> tuple[Collection | None, CollectionFailed | None]:
    """The collection and the runner side by side; the final collection (None if it was
    stopped by ``-x`` or an interrupt) and the collection's failure, if any."""
    if server is not None:
        server.attach()
    try:
        running = asyncio.create_task(runner.run([]))
        collecting = asyncio.create_task(
            collect_streaming(
                paths, args, settings["collect_timeout"], feeder.on_event, server, cache, defer
            )
        )
        return await run_beside(collecting, running, feeder)
    finally:
        if server is not None:
            server.detach()


async def run_beside(
    collecting: asyncio.Task[Collection], running: asyncio.Task[Any], feeder: Feeder
) -> tuple[Collection | None, CollectionFailed | None]:
    """Wait for a streaming collection and the run it feeds (``feeder.runner``: one machine's
    ``Runner`` or a ``--ray`` run's driver) to end; the final collection (None if the run
    stopped it: ``-x``, an interrupt) and the collection's failure, if any.

    When the collection ends first the feeder reconciles its final report
    (``Feeder.finish``) and the run's input is closed: it ends with its last file.
    """
    runner = feeder.runner
    await asyncio.wait({running, collecting}, return_when=asyncio.FIRST_COMPLETED)
    collection: Collection | None = None
    failure: CollectionFailed | None = None
    if not collecting.done():  # the runner stopped first: -x or an interrupt
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, CollectionFailed):
            await collecting
    else:
        try:
            collection = collecting.result()
        except CollectionFailed as exc:
            failure = exc
            runner.stop("collection failed")
        else:
            feeder.finish(collection)
    feeder.stop_early()
    runner.close_input()
    await running
    return collection, failure


def live_reporter(
    reporter: ConsoleReporter,
    cards: Sequence[Card],
    cpu_slots: int,
    total: int,
    collecting: bool = False,
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

    return LiveReporter(
        [c.id for c in cards], cpu_slots, total, Console(file=reporter.out), collecting=collecting
    )


def prepare_plan(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter,
) -> Prepared | int:
    """``plan``'s collection, its warnings and errors said; the exit code if there is nothing to plan."""
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
    return prepared


def say_requirements(reporter: ConsoleReporter, prepared: Prepared, jobs: Sequence[Job]) -> None:
    """``plan``'s table: each file, what it needs, its test count, expected seconds, and the
    cores its process tree used on average and at peak (``-``: never measured)."""
    reporter.say(f"{'file':<60} {'needs':<16} {'tests':>5} {'expected':>9} {'cpu':>5} {'peak':>5}")
    tests = {entry.path: len(entry.tests) for entry in prepared.collection.files}
    for job in jobs:
        entry = prepared.entries.get(job.path)
        peak = entry.peak if entry is not None else None
        reporter.say(
            f"{display_path(job.path):<60} {job.requirement.describe():<16} "
            f"{tests[job.path]:>5} {job.expected:>8.1f}s {_cores(job.cpu):>5} {_cores(peak):>5}"
        )
    unmeasured = sum(1 for job in jobs if job.cpu is None)
    if unmeasured:
        reporter.say(
            f"gpusched: CPU use of {unmeasured} of {len(jobs)} files never measured: each "
            f"counts {UNMEASURED_CPU_FILE:g} core, a GPU file {UNMEASURED_GPU_FILE:g} beside its cards"
        )


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plan(
    paths: Sequence[str],
    settings: dict[str, Any],
    pytest_args: Sequence[str],
    reporter: ConsoleReporter | None = None,
) -> int:
    """``gpusched plan``: requirements and the predicted schedule; runs nothing."""
    reporter = reporter or ConsoleReporter()
    prepared = prepare_plan(paths, settings, pytest_args, reporter)
    if isinstance(prepared, int):
        return prepared
    say_requirements(reporter, prepared, prepared.jobs)
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
        + (f" and {settings['durations_seed']}" if settings["durations_seed"] else "")
        + (", the others get their mean" if prepared.known < len(prepared.jobs) else "")
    )
    eta = time.strftime("%H:%M:%S", time.localtime(time.time() + makespan))
    reporter.say(
        f"gpusched: predicted makespan {makespan:.1f}s for {len(runs)} files (ETA {eta} if started now)"
    )
    return EXIT_FAILED if prepared.collection.errors else EXIT_OK
