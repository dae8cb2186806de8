"""Coverage of what runs in Ray workers, N-rank ranks and submitted jobs, merged into the session's.

When a test session is measured by coverage.py (pytest-cov's ``--cov``,
``coverage run -m pytest``, or coverage's start-up variable), the processes the
fixtures start are measured too, under the session's own configuration
(``source``, ``omit``, ``branch``, ``[paths]``, sources given on the command
line included: they are read from the running :class:`coverage.Coverage`).
With coverage off nothing here runs: :func:`start_measuring` returns ``None``
without importing coverage, and no variable or runtime env is changed.

How a process gets measured: coverage.py (7.10 and later) installs a ``.pth``
file that starts measuring any Python process whose environment carries
``COVERAGE_PROCESS_CONFIG`` (a serialized configuration), before the first
line of user code. :class:`WorkerCoverage` puts that variable where the
fixtures start processes: the runtime env of ``e2e_ray`` clusters (Ray tasks
and actors, ``__init__`` included), the environment the ranks of
``e2e_distributed`` run in (forked, not started, so each calls coverage's
start-up function itself as the ``.pth`` file would: :mod:`rl_e2e.distributed`),
the runtime env of ``e2e_ray_job`` jobs (the job's driver and its workers). The configuration is the session's with
four changes: each process writes a data file of its own (``parallel``) in a
private directory, coverage saves on SIGTERM, its lines carry the static
context :data:`WORKER_CONTEXT` (a report can leave them out), and this module
is loaded as a coverage plugin in the process (:func:`coverage_init`).

How their data is kept: a process that exits saves at exit, as coverage always
does. Ray does not let its workers exit: ``ray.shutdown()`` kills them, and so
does ``ray.kill``. So in each measured process the plugin registers the
process in the private directory and installs a handler for
:data:`SAVE_SIGNAL` that saves the data it holds; :meth:`WorkerCoverage.save`
signals every registered process still alive and waits until each has saved
(or is gone), before a cluster is shut down and before a test's leftover
actors are killed.

How it is merged: :meth:`WorkerCoverage.merge` combines the private data files
into one data file next to the session's data file, with the session's data
suffix scheme (``.coverage.HOST.PID.RANDOM``), which pytest-cov combines at the
end of the session as it combines its own (``coverage combine`` does it after
``coverage run``). Files that Ray ran from its copies of a ``working_dir`` or
``py_modules`` (``.../runtime_resources/working_dir_files/_ray_pkg_HASH/...``)
are mapped back to the directories they were copied from; a copy that maps
nowhere is left out, with a warning, so no path of Ray's appears in a report.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coverage import Coverage, CoverageData
    from coverage.config import CoverageConfig

__all__ = [
    "CONFIG_VARIABLE",
    "FILE_VARIABLE",
    "CoverageNotMergedWarning",
    "SAVE_SIGNAL",
    "START_VARIABLE",
    "WORKER_CONTEXT",
    "WorkerCoverage",
    "check_start_variable",
    "copy_roots",
    "coverage_init",
    "map_ray_copy",
    "package_names",
    "save_processes",
    "session_coverage",
    "start_measuring",
]

# coverage.py's own start-up variables, read by the .pth file it installs.
WORKER_CONTEXT = "rl_e2e-worker"
"""The static context of what Ray workers, ranks and jobs measured, so a report can tell it
from the test processes' own (``coverage report --contexts``, ``coverage html --show-contexts``)."""
CONFIG_VARIABLE = "COVERAGE_PROCESS_CONFIG"
START_VARIABLE = "COVERAGE_PROCESS_START"
FILE_VARIABLE = "COVERAGE_FILE"  # overrides a configuration's data_file
# Ray's workers take SIGTERM for themselves, and the ranks take SIGUSR1 for their stacks.
SAVE_SIGNAL = signal.SIGUSR2

_DATA_NAME = ".coverage"
_REGISTERED = "pid."
_SAVED = "saved."
# A Ray worker runs a Python signal handler when its task loop next checks for
# signals (within 0.1 s when idle); one busy in native code answers when it is back.
_SAVE_TIMEOUT_S = 30.0
_RAY_COPY = re.compile(
    r"^.*/runtime_resources/(?:working_dir_files|py_modules_files)/_ray_pkg_[0-9a-f]+"
    r"/(?P<relative>.+)$"
)


class CoverageNotMergedWarning(UserWarning):
    """Some data measured in a worker, rank or job could not be kept (the message says which)."""


def session_coverage() -> Coverage | None:
    """The :class:`coverage.Coverage` measuring this process now, or ``None``.

    Imports nothing: coverage off means coverage was never imported.
    """
    module = sys.modules.get("coverage")
    if module is None:
        return None
    return module.Coverage.current()


def check_start_variable(environ: Mapping[str, str]) -> None:
    """Refuse a ``COVERAGE_PROCESS_START`` whose file coverage cannot read.

    coverage's ``.pth`` file only prints a traceback at start-up and lets the
    process run unmeasured; a session started so would report nothing of its
    workers either. Does nothing (imports nothing) when the variable is unset.

    Raises:
        ValueError: one line naming the variable, the file and coverage's reason.
    """
    path = environ.get(START_VARIABLE)
    if path is None:
        return
    import coverage

    try:
        coverage.Coverage(config_file=path)
    except Exception as err:  # noqa: BLE001 - coverage's errors and configparser's alike
        reason = " ".join(str(err).split())
        raise ValueError(
            f"{START_VARIABLE}={path}: coverage cannot read this configuration: {reason}"
        ) from None


def copy_roots(runtime_env: Mapping[str, Any] | None, cwd: Path | None = None) -> list[Path]:
    """The local directories Ray copies for ``runtime_env``: its ``working_dir``, and the
    parent of each ``py_modules`` entry (Ray keeps a module's own name inside its copy).

    Relative paths are taken from ``cwd`` (default: the current directory), as
    Ray takes them; remote URIs (``s3://``, ``gcs://``) have no local root.
    """
    runtime_env = runtime_env or {}
    base = cwd or Path.cwd()
    locals_: list[Path] = []
    working_dir = runtime_env.get("working_dir")
    if isinstance(working_dir, str | os.PathLike) and "://" not in str(working_dir):
        locals_.append((base / working_dir).resolve())
    for module in runtime_env.get("py_modules") or ():
        if isinstance(module, str | os.PathLike) and "://" not in str(module):
            locals_.append((base / module).resolve().parent)
    return locals_


def map_ray_copy(path: str, roots: Iterable[Path]) -> str | None:
    """Where a file Ray ran from its copy of a working dir or module came from.

    ``path`` itself when it is no copy of Ray's; the first of ``roots`` holding
    the same relative path when it is; ``None`` when none does.
    """
    match = _RAY_COPY.match(path)
    if match is None:
        return path
    relative = match.group("relative")
    for root in roots:
        candidate = root / relative
        if candidate.is_file():
            return str(candidate)
    return None


def package_names(directory: Path) -> list[str]:
    """The dotted names the code of a ``source`` directory is imported under.

    A package directory gives its own dotted name (``src/pkg/sub`` -> ``pkg.sub``);
    another directory, the packages directly inside it. Ray's copy of the
    directory is measured by these names: its files are elsewhere.
    """
    if (directory / "__init__.py").is_file():
        parts = [directory.name]
        parent = directory.parent
        while (parent / "__init__.py").is_file():
            parts.insert(0, parent.name)
            parent = parent.parent
        return [".".join(parts)]
    return sorted(
        child.name
        for child in directory.iterdir()
        if child.is_dir() and (child / "__init__.py").is_file() and child.name.isidentifier()
    )


@dataclass
class WorkerCoverage:
    """Measurement of the processes one fixture starts, kept apart until :meth:`merge`.

    ``directory`` is private (the processes' data files and registrations);
    ``target`` the session's data file, next to which the merged file goes;
    ``config`` the processes' coverage configuration (a copy of the session's);
    ``roots`` where Ray's copies map back to (grown by :meth:`runtime_env`).
    """

    directory: Path
    target: Path
    config: CoverageConfig = field(repr=False)
    roots: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The variables that make coverage measure a Python process from its start, into
        the private directory (``COVERAGE_FILE`` too: the session's would override it)."""
        return {CONFIG_VARIABLE: self.config.serialize(), FILE_VARIABLE: self.config.data_file}

    def runtime_env(self, runtime_env: Mapping[str, Any] | None) -> dict[str, Any]:
        """A copy of ``runtime_env`` whose processes are measured, Ray's copies included.

        The ``source`` directories inside what Ray copies (``working_dir``,
        ``py_modules``) are measured in the copies by their package names.
        """
        roots = copy_roots(runtime_env)
        self.roots += [root for root in roots if root not in self.roots]
        config = copy.deepcopy(self.config)
        for source in config.source or ():
            directory = Path(source)
            if directory.is_dir() and any(directory.is_relative_to(root) for root in roots):
                names = package_names(directory)
                config.source_pkgs += [name for name in names if name not in config.source_pkgs]
        measured = dict(runtime_env or {})
        measured["env_vars"] = {
            **(measured.get("env_vars") or {}),
            CONFIG_VARIABLE: config.serialize(),
            FILE_VARIABLE: config.data_file,
        }
        return measured

    def save(self, timeout_s: float = _SAVE_TIMEOUT_S) -> list[int]:
        """Ask every measured process still alive to save its data; wait until each has.

        Called before Ray kills workers (a cluster's shutdown, leftover actors
        removed). Returns the pids that neither saved nor exited within
        ``timeout_s`` (their data since their last save is lost; a warning says so).
        """
        return save_processes(self.directory, timeout_s)

    def merge(self) -> Path | None:
        """Combine the processes' data into one file beside the session's data file; clean up.

        Returns the file written (``None`` when no process left data). Never
        raises: a data file that cannot be read (a process killed while
        writing it) is left out with a warning, as are files of Ray's copies
        that map to no local directory.
        """
        try:
            return self._merge()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _merge(self) -> Path | None:
        from coverage import CoverageData
        from coverage.exceptions import CoverageException

        merged: CoverageData | None = None
        unreadable: list[str] = []
        unmapped: set[str] = set()
        for path in sorted(self.directory.glob(f"{_DATA_NAME}.*")):
            try:
                data = CoverageData(basename=str(path))
                data.read()
                if not data.measured_files():
                    continue
                kept = self._mapped(data, unmapped)
                if merged is None:
                    merged = CoverageData(basename=str(self.target), suffix=True)
                merged.update(kept, map_path=lambda name: map_ray_copy(name, self.roots) or name)
            except (CoverageException, OSError) as err:
                unreadable.append(f"{path.name} ({err})")
        if unreadable:
            _warn(f"could not read {len(unreadable)} data file(s): {'; '.join(unreadable)}")
        if unmapped:
            _warn(
                "left out files Ray ran from copies that match no local directory: "
                + ", ".join(sorted(unmapped))
            )
        if merged is None:
            return None
        merged.write()
        return Path(merged.data_filename())

    def _mapped(self, data: CoverageData, unmapped: set[str]) -> CoverageData:
        """``data`` itself, or a copy without the files of Ray's copies that map nowhere."""
        from coverage import CoverageData

        dropped = {name for name in data.measured_files() if map_ray_copy(name, self.roots) is None}
        if not dropped:
            return data
        unmapped.update(dropped)
        kept = CoverageData(no_disk=True)
        for name in data.measured_files() - dropped:
            arcs = data.arcs(name)
            if data.has_arcs() and arcs is not None:
                kept.add_arcs({name: arcs})
            else:
                kept.add_lines({name: data.lines(name) or []})
            tracer = data.file_tracer(name)
            if tracer:
                kept.add_file_tracers({name: tracer})
        return kept


def save_processes(
    directory: Path, timeout_s: float = _SAVE_TIMEOUT_S, exclude: int | None = None
) -> list[int]:
    """Signal the processes registered in ``directory`` to save; wait until each has saved
    or exited; return the pids of those that did neither in ``timeout_s`` (with a warning).

    ``exclude``: a pid not to ask (the caller's own). A registered pid now held
    by another process (its creation time differs from the one registered) is
    not signalled.
    """
    import psutil

    asked: dict[int, Any] = {}
    for entry in directory.glob(f"{_REGISTERED}*"):
        pid = int(entry.name.removeprefix(_REGISTERED))
        if pid == exclude:
            continue
        with contextlib.suppress(psutil.Error, OSError, ValueError):
            process = psutil.Process(pid)
            if process.create_time() != float(entry.read_text()):
                continue  # the pid of a process gone, handed to another since
            (directory / f"{_SAVED}{pid}").unlink(missing_ok=True)
            process.send_signal(SAVE_SIGNAL)
            asked[pid] = process
    deadline = time.monotonic() + timeout_s
    while asked and time.monotonic() < deadline:
        for pid in list(asked):
            if (directory / f"{_SAVED}{pid}").exists() or not _alive(asked[pid]):
                del asked[pid]
        if asked:
            time.sleep(0.05)
    if asked:
        warnings.warn(
            CoverageNotMergedWarning(
                f"rl_e2e: coverage: {len(asked)} measured process(es) did not save their "
                f"data within {timeout_s:g} s (pids {sorted(asked)}); what they ran since "
                "their last save is not counted"
            ),
            stacklevel=2,
        )
    return sorted(asked)


def _warn(message: str) -> None:
    warnings.warn(CoverageNotMergedWarning(f"rl_e2e: coverage: {message}"), stacklevel=3)


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_measuring() -> WorkerCoverage | None:
    """A :class:`WorkerCoverage` under the session's configuration, or ``None`` with coverage off.

    Its data goes beside the session's data file as it is named now (a relative
    one is taken from the current directory).
    """
    cov = session_coverage()
    if cov is None:
        return None
    directory = Path(tempfile.mkdtemp(prefix="rl_e2e-coverage-"))
    config = copy.deepcopy(cov.config)
    config.data_file = str(directory / _DATA_NAME)
    config.parallel = True
    config.sigterm = True
    config.context = f"{config.context}-{WORKER_CONTEXT}" if config.context else WORKER_CONTEXT
    config.plugins = [*config.plugins, __name__]
    config.plugin_options = {**config.plugin_options, __name__: {"directory": str(directory)}}
    if config.source is not None:  # absolute, as the serialized form has them
        config.source = [
            os.path.abspath(src) if os.path.isdir(src) else src for src in config.source
        ]
    return WorkerCoverage(
        directory=directory,
        target=Path(cov.config.data_file).absolute(),
        config=config,
    )


def coverage_init(reg: Any, options: Mapping[str, str]) -> None:
    """coverage's plugin entry point, run in each measured process as coverage starts.

    Registers the process (pid and creation time) in the private directory and
    installs the handler of :data:`SAVE_SIGNAL`, which saves what the process
    measured so far and says so with a file (``saved.PID``). In a process that
    ends as a Ray driver (a submitted job's), has the workers save before Ray's
    own exit handler disconnects the driver: Ray then kills the job's workers.
    The process imports what coverage does not measure without its tracer
    (:mod:`rl_e2e.untraced_imports`): a worker imports torch and its kin.
    Registers no plugin object.
    """
    from rl_e2e.untraced_imports import install

    install()
    directory = Path(options["directory"])

    def save_now(signum: int, frame: object) -> None:
        import coverage

        cov = coverage.Coverage.current()
        if cov is not None:
            cov.save()
        (directory / f"{_SAVED}{os.getpid()}").touch()

    try:
        # Run from coverage's .pth at start-up, in the main thread, before Ray
        # or a rank's code install handlers of their own.
        signal.signal(SAVE_SIGNAL, save_now)
    except ValueError:  # coverage started in another thread: not a process we signal
        return
    import psutil

    # Written whole before it is named: a reader never sees half of it.
    registration = directory / f"{_REGISTERED}{os.getpid()}"
    partial = registration.with_name(f"partial.{os.getpid()}")
    partial.write_text(repr(psutil.Process().create_time()))
    partial.replace(registration)
    # Ray's exit handler is registered with atexit when ray is imported, after
    # this; threading's exit callbacks run before any atexit handler.
    register = getattr(threading, "_register_atexit", atexit.register)
    register(_save_workers_of_driver, directory)


def _save_workers_of_driver(directory: Path) -> None:
    """At the exit of a connected Ray driver: every other measured process saves now."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if ray._private.worker.global_worker.mode != ray.SCRIPT_MODE:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nobody reads a job driver's warnings at exit
        save_processes(directory, exclude=os.getpid())
