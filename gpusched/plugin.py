"""The pytest plugin: GPU markers, ``-m gpu2`` keywords, skips, and reports for the scheduler.

Loaded by plain ``pytest`` through the ``pytest11`` entry point, so markers and
skips work without gpusched. Under ``gpusched`` it also writes the collection
report (``--gpusched-report``) and streams each test's outcome as it finishes
(``--gpusched-results``), so a child that is killed or crashes keeps the
outcomes of the tests it finished. With each outcome go the testcase(s) pytest's
own ``--junitxml`` would write for the test, under this child's ``junit_*`` ini
settings (``gpusched.reporting.junit``), and each failed phase's traceback and
report sections as pytest's terminal shows them: the parent's merged JUnit and
console say what plain pytest says. With ``--gpusched-cache`` the collection
skips files whose key is unchanged, and with ``--gpusched-expect`` a child checks
such a cached prediction against its own collection (``gpusched.collection.cache``).
With ``--gpusched-stream`` the collection also streams each file's entry as soon
as pytest has collected that file (``gpusched.collection.collect``), so the
scheduler starts it while the rest is still being collected.
All plugin state lives in ``config.stash``.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import tomllib

from gpusched.collection.cache import (
    CachedFile,
    base_key,
    conftest_chain,
    entry_json,
    file_key,
    load_cache,
    relative_key,
)
from gpusched.coverage import COVERAGE_DIR_VARIABLE
from gpusched.execution.warmstart import wait_at_gate
from gpusched.inventory import visible_gpu_count
from gpusched.reporting.junit import (
    JUNIT_LOGGING,
    JunitCases,
    Phase,
    collect_error_case,
    junit_names,
    shown_sections,
)
from gpusched.requirements import (
    SHORTHAND_MARKERS,
    Requirement,
    RequirementError,
    requirement_from_glob_value,
    requirement_from_marker,
)
from gpusched.results import (
    DEFERRED,
    EXIT_RECOLLECTED,
    JunitCase,
    PhaseReport,
    parse_expectation,
    tests_hash,
)

MARKER_HELP = {
    "gpu": "gpu(n, memory=None): the test needs n GPUs, each with at least `memory` "
    "(e.g. '40GB'); skipped when fewer are visible",
    **{name: f"{name}: shorthand for gpu({n})" for name, n in SHORTHAND_MARKERS.items()},
}
GPU_MARKERS = frozenset(MARKER_HELP)
# Bound at import: a test may replace ``json.dumps`` (or ``os.replace``) in the process it runs
# in, and its file must still report exactly what plain pytest reports.
_encode = json.JSONEncoder().encode
_replace = os.replace
TEXT_LIMIT = 200_000  # characters of a traceback streamed back (its end); pytest writes all
SECTION_LIMIT = 64_000  # characters of one report section streamed back (its end)


@dataclass(frozen=True)
class _Junit:
    """The child's JUnit settings, read once: what pytest's own ``--junitxml`` would use here."""

    logging: str = "no"  # junit_logging
    log_passing_tests: bool = True  # junit_log_passing_tests
    duration_report: str = "total"  # junit_duration_report
    prefix: str | None = None  # --junitprefix
    showcapture: str = "all"  # --show-capture: the sections the console shows
    mangle: Callable[[str], list[str]] | None = None  # pytest's mangle_test_address
    shorten: Callable[[str], str] | None = None  # pytest's shorten_message (pytest >= 9)

    @classmethod
    def of(cls, config: pytest.Config) -> _Junit:
        def ini(name: str, default: Any) -> Any:
            try:
                return config.getini(name)
            except ValueError:  # ``-p no:junitxml``: pytest's defaults
                return default

        try:
            from _pytest import junitxml
        except ImportError:
            junitxml = None  # type: ignore[assignment]
        logging = ini("junit_logging", "no")
        return cls(
            logging if logging in JUNIT_LOGGING else "no",
            bool(ini("junit_log_passing_tests", True)),
            ini("junit_duration_report", "total"),
            getattr(config.option, "junitprefix", None),
            getattr(config.option, "showcapture", "all") or "all",
            getattr(junitxml, "mangle_test_address", None),
            getattr(junitxml, "shorten_message", None),
        )

    def names(self, nodeid: str) -> tuple[str, str]:
        """``(classname, name)`` from the child's own pytest, else gpusched's copy of its rule."""
        if self.mangle is not None:
            try:
                names = list(self.mangle(nodeid))
            except Exception:  # noqa: BLE001 - pytest's private API moved: use the copy
                pass
            else:
                classnames = names[:-1]
                if self.prefix:
                    classnames.insert(0, self.prefix)
                return ".".join(classnames), names[-1]
        return junit_names(nodeid, self.prefix)

    def cases(self) -> JunitCases:
        shorten = self.shorten or (lambda message: message)
        return JunitCases(self.logging, self.log_passing_tests, self.duration_report, shorten)


@dataclass
class _State:
    """Everything the plugin remembers during one session."""

    globs: dict[str, Requirement] = field(default_factory=dict)
    requirements: dict[str, Requirement] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    selected: list[pytest.Item] = field(default_factory=list)
    visible: int | None = None
    results: IO[str] | None = None
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    junit: _Junit = field(default_factory=_Junit)
    base: str | None = None  # the collection cache's base key; None: cache off
    cache: dict[str, CachedFile] = field(default_factory=dict)  # by path relative to rootdir
    keys: dict[str, str] = field(default_factory=dict)  # absolute path -> key, this session
    hits: dict[str, CachedFile] = field(default_factory=dict)  # absolute path -> cached entry
    collected: set[str] = field(default_factory=set)  # modules that collected without error
    conftests: dict[Path, bytes] = field(default_factory=dict)
    stream: IO[str] | None = None  # --gpusched-stream; None once streaming is off
    items: dict[str, list[pytest.Item]] = field(default_factory=dict)  # by file, until reported
    since: dict[str, float] = field(default_factory=dict)  # by file: when its collection began
    defer: bool = False  # --gpusched-defer: files the cache does not know are not imported
    deferred: dict[str, Requirement] = field(default_factory=dict)  # path -> glob requirement


STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpusched", "GPU scheduling (used by the gpusched command)")
    group.addoption(
        "--gpusched-report",
        metavar="PATH",
        help="write each collected file's GPU requirement and test ids as JSON to PATH",
    )
    group.addoption(
        "--gpusched-results",
        metavar="PATH",
        help="append one JSON line per test outcome to PATH, as each test finishes",
    )
    group.addoption(
        "--gpusched-cache",
        metavar="PATH",
        help="with --gpusched-report: do not import files whose entry in this collection "
        "cache is still valid",
    )
    group.addoption(
        "--gpusched-context",
        metavar="HEX",
        default="",
        help="the runner's part of every collection-cache key",
    )
    group.addoption(
        "--gpusched-stream",
        metavar="PATH",
        help="with --gpusched-report: append each file's entry to PATH as JSON lines "
        "as soon as the file is collected",
    )
    group.addoption(
        "--gpusched-defer",
        action="store_true",
        help="with --gpusched-cache: do not import the files the cache does not know either; "
        "each one's own run collects it",
    )
    group.addoption(
        "--gpusched-expect",
        metavar="GPUS:MEMORY:HASH",
        help="stop before running if this file's requirement differs from this prediction",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """A warm-started child waits here for its cards, before any conftest or test module loads."""
    wait_at_gate()


@pytest.hookimpl(specname="pytest_load_initial_conftests")
def pytest_load_initial_conftests_untraced(early_config: pytest.Config) -> None:
    """In a file's process that a measuring run measures, the libraries that conftests and
    test modules import import without coverage's tracer (:mod:`rl_e2e.untraced_imports`).

    After pytest-cov started measuring (its hook runs first), before the conftests load.
    A pytest that a test starts inherits the run's variable but is not measured: it
    imports nothing here.
    """
    coverage = sys.modules.get("coverage")
    if os.environ.get(COVERAGE_DIR_VARIABLE) and coverage and coverage.Coverage.current():
        from rl_e2e.untraced_imports import install

        install()


def pytest_configure(config: pytest.Config) -> None:
    for text in MARKER_HELP.values():
        config.addinivalue_line("markers", text)
    state = _State(globs=_load_globs(config))
    cache = config.getoption("gpusched_cache", None)
    if cache and not config.getoption("doctestmodules", False):
        state.base = base_key(
            config.getoption("gpusched_context", ""),
            pytest.__version__,
            _read(config.inipath),
            _read(Path(config.rootpath) / "pyproject.toml"),
        )
        state.cache = load_cache(Path(cache))
        state.defer = bool(config.getoption("gpusched_defer", False))
    results = config.getoption("gpusched_results", None)
    if results:
        state.results = open(results, "a", encoding="utf-8")  # noqa: SIM115 - closed at unconfigure
        state.junit = _Junit.of(config)
    stream = config.getoption("gpusched_stream", None)
    if stream:
        state.stream = open(stream, "a", encoding="utf-8")  # noqa: SIM115 - closed at unconfigure
    config.stash[STATE] = state
    config.pluginmanager.register(_SessionHooks(config), "gpusched-session")
    if os.environ.get(COVERAGE_DIR_VARIABLE):
        from gpusched.coverage.child import adopt

        adopt(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None and state.results is not None:
        state.results.close()
        state.results = None
    if state is not None and state.stream is not None:
        state.stream.close()
        state.stream = None


def _read(path: Path | None) -> bytes | None:
    try:
        return None if path is None else Path(path).read_bytes()
    except OSError:
        return None


class _CachedModule(pytest.File):
    """A test file the collection cache already knows: collected as nothing, never imported."""

    def collect(self) -> list[pytest.Item]:
        return []


def _load_globs(config: pytest.Config) -> dict[str, Requirement]:
    pyproject = Path(config.rootpath) / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise pytest.UsageError(f"{pyproject}: cannot read [tool.gpusched.gpus]: {exc}") from None
    table = data.get("tool", {}).get("gpusched", {}).get("gpus", {})
    if not isinstance(table, dict):
        raise pytest.UsageError(
            f"{pyproject}: [tool.gpusched.gpus] must be a table of glob = count"
        )
    try:
        return {
            pattern: requirement_from_glob_value(pattern, value) for pattern, value in table.items()
        }
    except RequirementError as exc:
        raise pytest.UsageError(f"{pyproject}: {exc}") from None


def _glob_requirement(
    path: Path, config: pytest.Config, globs: dict[str, Requirement]
) -> Requirement:
    """What ``[tool.gpusched.gpus]`` says a file needs, without importing it (markers may differ)."""
    try:
        relative = path.resolve().relative_to(Path(config.rootpath).resolve()).as_posix()
    except ValueError:  # a test file outside the rootdir: no glob can name it
        return Requirement()
    return next(
        (r for pattern, r in globs.items() if fnmatch.fnmatch(relative, pattern)), Requirement()
    )


def _deferred_entry(state: _State, path: str) -> dict[str, Any] | None:
    """A deferred file's entry (tests unknown until its own run), if it was collected."""
    requirement = state.deferred.get(path)
    if requirement is None or path not in state.collected:
        return None
    gpus, memory = requirement.gpus, requirement.memory
    return {
        "gpus": gpus,
        "memory": memory,
        "tests": [],
        "levels": [[gpus, memory]],
        "deferred": True,
    }


def item_requirement(item: pytest.Item, globs: dict[str, Requirement]) -> Requirement:
    """A test's requirement: its GPU markers if it has any, else the first matching path glob."""
    marks = [mark for mark in item.iter_markers() if mark.name in GPU_MARKERS]
    if marks:
        requirement = Requirement()
        for mark in marks:
            try:
                requirement = requirement.combine(
                    requirement_from_marker(mark.name, mark.args, mark.kwargs)
                )
            except RequirementError as exc:
                raise RequirementError(f"{item.nodeid}: {exc}") from None
        return requirement
    return _glob_requirement(Path(item.path), item.config, globs)


class _SessionHooks:
    """Hooks that pytest calls without a config; this object carries it. State stays in the stash."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @property
    def state(self) -> _State:
        return self.config.stash[STATE]

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        """Turn a bad GPU marker into a collection error of its file, naming test and marker."""
        report = yield
        if report.outcome != "passed" or not report.result:
            return report
        problems = []
        for node in report.result:
            if not isinstance(node, pytest.Item):
                continue
            try:
                requirement = item_requirement(node, self.state.globs)
            except RequirementError as exc:
                problems.append(str(exc))
                continue
            self.state.requirements[node.nodeid] = requirement
            if requirement.gpus:
                node.add_marker("gpu")
                node.add_marker(f"gpu{requirement.gpus}")
        if problems:
            report.outcome = "failed"
            report.longrepr = "bad GPU marker:\n" + "\n".join(problems)
            report.result = []
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(
        self, module_path: Path, parent: pytest.Collector
    ) -> pytest.File | None:
        """A file whose key the cache knows is not imported: its entry stands in for it."""
        state = self.state
        if state.base is None or module_path.name == "__init__.py":
            return None
        try:
            conftests = []
            for conftest in conftest_chain(module_path):
                if conftest not in state.conftests:
                    state.conftests[conftest] = conftest.read_bytes()
                conftests.append(state.conftests[conftest])
            key = file_key(state.base, module_path.read_bytes(), conftests)
        except OSError:
            return None
        path = str(module_path.resolve())
        state.keys[path] = key
        relative = relative_key(path, self.config.rootpath)
        entry = None if relative is None else state.cache.get(relative)
        if entry is None or entry.key != key:
            if not state.defer:
                return None
            state.deferred[path] = _glob_requirement(module_path, self.config, state.globs)
        else:
            state.hits[path] = entry
        return _CachedModule.from_parent(parent, path=module_path)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> None:
        """Open the stream: the rootdir first, or why this collection cannot stream."""
        state = self.state
        if state.stream is None:
            return
        reason = _untrusted_selection(self.config)
        _write_line(state.stream, {"event": "start", "rootdir": str(self.config.rootpath)})
        if reason is not None:
            _write_line(state.stream, {"event": "off", "reason": reason})
            state.stream.close()
            state.stream = None

    def pytest_collectstart(self, collector: pytest.Collector) -> None:
        if self.state.stream is not None and isinstance(collector, pytest.File):
            self.state.since[str(Path(collector.path).resolve())] = time.perf_counter()

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if self.state.stream is not None:
            self.state.items.setdefault(str(Path(item.path).resolve()), []).append(item)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        path = str((Path(self.config.rootpath) / report.nodeid.split("::")[0]).resolve())
        if report.passed and "::" not in report.nodeid and path in self.state.keys:
            self.state.collected.add(path)
        error = skip = None
        if report.failed:
            error = {"nodeid": report.nodeid, "path": path, "message": str(report.longrepr)}
            self.state.errors.append(error)
            if self.state.results is not None:
                classname, name = self.state.junit.names(report.nodeid)
                case = collect_error_case(_tail(error["message"], TEXT_LIMIT)).to_json()
                _emit(
                    self.state,
                    {"event": "collecterror", **error, "classname": classname, "name": name,
                     "cases": [case]},
                )  # fmt: skip
        elif report.skipped and isinstance(report.longrepr, tuple):
            skip = {"nodeid": report.nodeid, "path": path, "message": str(report.longrepr[2])}
            self.state.skipped.append(skip)
        if self.state.stream is not None and "::" not in report.nodeid:
            self._stream_file(path, error, skip)

    def _stream_file(
        self, path: str, error: dict[str, str] | None, skip: dict[str, str] | None
    ) -> None:
        """One file is collected: stream its entry, error or skip (directories stream nothing).

        The entry predicts what the whole collection will select: ``-k``, ``-m``
        and ``--deselect`` are applied here as pytest applies them at the end
        (``_untrusted_selection`` turns streaming off where other hooks could
        change the selection). The file's own child checks the prediction.
        """
        state = self.state
        assert state.stream is not None
        items = state.items.pop(path, [])
        since = state.since.pop(path, None)
        seconds = 0.0 if since is None else round(time.perf_counter() - since, 4)
        if error is not None:
            _write_line(state.stream, {"event": "error", **error})
            return
        if skip is not None:
            _write_line(state.stream, {"event": "skipped", **skip})
            return
        deferred = _deferred_entry(state, path)
        if deferred is not None:
            _write_line(state.stream, {"event": "file", "path": path, **deferred})
            return
        cached = state.hits.get(path)
        if cached is not None:
            if cached.tests:
                _write_line(
                    state.stream,
                    {"event": "file", "path": path, **entry_json(cached), "cached": True},
                )
            return
        if not Path(path).is_file():
            return
        try:
            selected = _predicted_selection(items, self.config)
        except Exception as exc:  # noqa: BLE001 - pytest's private API moved: stop streaming
            _write_line(state.stream, {"event": "off", "reason": f"cannot predict -k/-m: {exc}"})
            state.stream.close()
            state.stream = None
            return
        for file, entry in _file_entries(selected, state.requirements).items():
            _write_line(state.stream, {"event": "file", "path": file, **entry, "seconds": seconds})

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.state.selected = list(items)
        expect = self.config.getoption("gpusched_expect", None)
        if expect:
            self._check_expectation(expect)

    def _check_expectation(self, expect: str) -> None:
        """Compare this child's own collection with the cache's prediction (``--gpusched-expect``).

        A different test list is streamed back; a different requirement also
        stops the file before its first test, to be queued again on the right cards.
        """
        if expect == DEFERRED:  # collection did not import it: this is its collection
            if self.state.errors:
                return  # nothing to remember: the next run collects it again
            files = _file_entries(self.state.selected, self.state.requirements)
            _emit(self.state, {"event": "collected", **next(iter(files.values()), _empty_entry())})
            return
        try:
            expected, expected_tests = parse_expectation(expect)
        except ValueError:
            raise pytest.UsageError(f"--gpusched-expect={expect!r}: not GPUS:MEMORY:HASH") from None
        files = _file_entries(self.state.selected, self.state.requirements)
        found = next(iter(files.values()), _empty_entry())  # a child runs one file
        requirement = Requirement(found["gpus"], found["memory"])
        if requirement == expected and tests_hash(found["tests"]) == expected_tests:
            return
        _emit(self.state, {"event": "collected", **found})
        if requirement != expected:
            pytest.exit(
                f"gpusched: this file needs {requirement.describe()}, not the "
                f"{expected.describe()} the collection cache predicted: queued again",
                returncode=EXIT_RECOLLECTED,
            )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        path = self.config.getoption("gpusched_report", None)
        if path:
            _write_report(self.config, self.state, Path(path))
        _emit(self.state, {"event": "finish", "exitstatus": int(exitstatus)})

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        needed = self.state.requirements.get(item.nodeid, Requirement()).gpus
        if not needed:
            return
        if self.state.visible is None:
            self.state.visible = visible_gpu_count()
        if needed > self.state.visible:
            pytest.skip(f"needs {needed} GPUs, {self.state.visible} visible")

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        _emit(self.state, {"event": "start", "nodeid": nodeid})

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold setup/call/teardown into one outcome per test and stream it at teardown.

        With it go what pytest's own ``--junitxml`` would write for the test
        (``gpusched.reporting.junit``) and each failed phase's traceback and report
        sections as pytest's terminal shows them. ``trylast``: sections that other
        plugins add to the report in their hooks are there by now.
        """
        state = self.state
        if state.results is None:
            return
        phase = state.phases.get(report.nodeid)
        if phase is None:
            phase = state.phases[report.nodeid] = {
                "outcome": None, "duration": 0.0, "message": "", "cases": state.junit.cases(),
                "reports": [],
            }  # fmt: skip
        phase["duration"] += report.duration
        outcome = _phase_outcome(report)
        if outcome is not None and _RANK[outcome] > _RANK.get(phase["outcome"], -1):
            phase["outcome"] = outcome
            phase["message"] = _message(report)
        phase["cases"].add(_junit_phase(report, state.junit.logging != "no"))
        if report.failed:
            sections = shown_sections(report.sections, state.junit.showcapture)
            phase["reports"].append(
                PhaseReport(
                    report.when,
                    _tail(_terminal_text(report), TEXT_LIMIT),
                    [(name, _tail(content, SECTION_LIMIT)) for name, content in sections],
                )
            )
        if report.when == "teardown":
            del state.phases[report.nodeid]
            classname, name = state.junit.names(report.nodeid)
            cases: list[JunitCase] = phase["cases"].cases
            _emit(
                state,
                {
                    "event": "result",
                    "nodeid": report.nodeid,
                    "outcome": phase["outcome"] or "passed",
                    "duration": round(phase["duration"], 6),
                    "message": phase["message"],
                    "classname": classname,
                    "name": name,
                    "cases": [case.to_json() for case in cases],
                    "reports": [r.to_json() for r in phase["reports"]],
                },
            )


# Plugins whose pytest_collection_modifyitems only reorders items or applies -k, -m and
# --deselect, which the stream predicts: any other implementation turns streaming off.
_PREDICTABLE = frozenset({"gpusched-session", "mark", "main", "funcmanage"})
_INACTIVE_UNLESS_ASKED = frozenset({"lfplugin", "nfplugin"})  # --lf, --ff, --nf

_MARKING_ONLY: dict[str, frozenset[str]] = {
    # pytest-benchmark: skip markers for --benchmark-skip / --benchmark-only; a skipped
    # test is still selected, and runs (as skipped) in its file's own process.
    "pytest_benchmark.plugin": frozenset({"skip"}),
    # Hypothesis: the `hypothesis` marker on its property tests.
    "_hypothesis_pytestplugin": frozenset({"hypothesis"}),
}
"""Third-party plugins (by module) found on GPU images whose hook only adds markers, and
those markers: the stream's prediction holds unless the ``-m`` expression names one."""


def _names_a_marker(markexpr: str, markers: frozenset[str]) -> bool:
    return any(re.search(rf"\b{re.escape(marker)}\b", markexpr) for marker in markers)


def _untrusted_selection(config: pytest.Config) -> str | None:
    """Why a file's streamed entry might differ from the final selection, or None."""
    manager = config.pluginmanager
    for impl in config.hook.pytest_collection_modifyitems.get_hookimpls():
        name = manager.get_name(impl.plugin) or repr(impl.plugin)
        if name in _PREDICTABLE:
            continue
        if name in _INACTIVE_UNLESS_ASKED and not getattr(impl.plugin, "active", True):
            continue
        module = getattr(impl.plugin, "__name__", None)
        if module in _MARKING_ONLY and not _names_a_marker(
            config.option.markexpr or "", _MARKING_ONLY[module]
        ):
            continue
        where = getattr(impl.plugin, "__file__", None) or name
        return f"{where} changes the selection in pytest_collection_modifyitems"
    return None


def _predicted_selection(items: list[pytest.Item], config: pytest.Config) -> list[pytest.Item]:
    """The items of one file that ``--deselect``, ``-k`` and ``-m`` will keep."""
    from _pytest.mark import KeywordMatcher, MarkMatcher, _parse_expression

    prefixes = tuple(config.getoption("deselect") or ())
    kept = [item for item in items if not (prefixes and item.nodeid.startswith(prefixes))]
    keyword = (config.option.keyword or "").lstrip()
    if keyword:
        expr = _parse_expression(keyword, "Wrong expression passed to '-k'")
        kept = [item for item in kept if expr.evaluate(KeywordMatcher.from_item(item))]
    markexpr = config.option.markexpr
    if markexpr:
        expr = _parse_expression(markexpr, "Wrong expression passed to '-m'")
        kept = [
            item for item in kept if expr.evaluate(MarkMatcher.from_markers(item.iter_markers()))
        ]
    return kept


def _empty_entry() -> dict[str, Any]:
    """A file's entry before any of its tests is seen: a CPU file with no tests."""
    return {"gpus": 0, "memory": None, "tests": [], "levels": []}


def _file_entries(
    items: list[pytest.Item], requirements: dict[str, Requirement]
) -> dict[str, dict[str, Any]]:
    """By file: its requirement (the most of its tests'), test ids, and its tests' distinct levels."""
    files: dict[str, dict[str, Any]] = {}
    for item in items:
        requirement = requirements.get(item.nodeid, Requirement())
        entry = files.setdefault(str(Path(item.path).resolve()), _empty_entry())
        combined = Requirement(entry["gpus"], entry["memory"]).combine(requirement)
        entry["gpus"], entry["memory"] = combined.gpus, combined.memory
        entry["tests"].append(item.nodeid)
        level = [requirement.gpus, requirement.memory]
        if level not in entry["levels"]:
            entry["levels"].append(level)
    return files


def _write_report(config: pytest.Config, state: _State, path: Path) -> None:
    """Write the collection report atomically: the scheduler never reads half a file."""
    files = _file_entries(state.selected, state.requirements)
    for file, cached in state.hits.items():
        # pytest makes a node for every file of a directory it walks, and collects only
        # those the arguments name: a hit counts only if its node was collected.
        if cached.tests and file in state.collected:
            files[file] = {**entry_json(cached), "cached": True}
    for file in state.deferred:
        entry = _deferred_entry(state, file)
        if entry is not None:
            files[file] = entry
    payload = {
        "rootdir": str(config.rootpath),
        "files": [{"path": p, **entry} for p, entry in files.items()],
        "keys": {p: key for p, key in state.keys.items() if p in state.collected},
        "errors": state.errors,
        "skipped": state.skipped,
    }
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(_encode(payload), encoding="utf-8")
    _replace(tmp, path)


_RANK = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 2, "failed": 3, "error": 4}


def _phase_outcome(report: pytest.TestReport) -> str | None:
    """One phase's outcome as a test outcome; None for a setup or teardown that passed.

    An xfail-marked test that fails is ``xfailed``, one that passes is ``xpassed``
    (a strict one fails: pytest reports it ``failed``, without ``wasxfail``).
    """
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        if report.failed:
            return "failed"
        return "xpassed" if xfail else "passed"
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def _message(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail") and not report.failed:
        return str(report.wasxfail)
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    if report.failed:
        return report.longreprtext[-4000:]
    return ""


def _junit_phase(report: pytest.TestReport, output: bool) -> Phase:
    """The parts of a phase report that pytest's junitxml reads (``gpusched.reporting.junit``);
    its captured output only if ``output`` (``junit_logging`` is not ``no``)."""
    longrepr = report.longrepr
    properties = [(str(name), str(value)) for name, value in report.user_properties]
    if report.passed and not output:  # the common case, kept cheap
        wasxfail = getattr(report, "wasxfail", None)
        return Phase(report.when, "passed", report.duration, wasxfail, properties=properties)
    crash = getattr(longrepr, "reprcrash", None)
    skip = longrepr if report.skipped and isinstance(longrepr, tuple) else None
    return Phase(
        report.when,
        report.outcome,
        report.duration,
        getattr(report, "wasxfail", None),
        None if crash is None else str(crash.message),
        _tail(str(longrepr), TEXT_LIMIT) if report.failed else "",
        None if skip is None else (str(skip[0]), skip[1], str(skip[2])),
        report.capstdout if output else "",
        report.capstderr if output else "",
        report.caplog if output else "",
        [(str(name), _tail(str(content), SECTION_LIMIT)) for name, content in report.sections]
        if report.failed
        else [],
        properties,
    )


def _terminal_text(report: pytest.TestReport) -> str:
    """The failure as pytest's terminal prints it, without colours (``longreprtext`` but
    for its first line's indentation, which ``longreprtext`` strips)."""
    try:
        from _pytest._io import TerminalWriter
    except ImportError:  # pytest's private API moved
        return report.longreprtext
    out = io.StringIO()
    writer = TerminalWriter(out)
    writer.hasmarkup = False
    report.toterminal(writer)
    return out.getvalue().rstrip()


def _tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text``: the end of a traceback or a log says most."""
    return text if len(text) <= limit else text[-limit:]


def _emit(state: _State, record: dict[str, Any]) -> None:
    if state.results is not None:
        _write_line(state.results, record)


def _write_line(stream: IO[str], record: dict[str, Any]) -> None:
    stream.write(_encode(record) + "\n")
    stream.flush()
