"""Collection: one ``pytest --collect-only`` subprocess that reports each file's requirement.

The child loads the gpusched plugin, which writes a JSON report to a temporary
file; that file is removed on every path, the timeout path included. The child
runs in its own process group and is killed as a tree if it hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpusched.execution.childenv import plugin_args
from gpusched.execution.forkclient import SERVER_DIED, ServerGone
from gpusched.execution.proctree import TAG_VARIABLE, kill_job
from gpusched.requirements import Requirement

if TYPE_CHECKING:
    from gpusched.execution.forkclient import ForkServer


class CollectionFailed(RuntimeError):
    """pytest could not collect at all (usage error, timeout, crash); ``exit_code`` is gpusched's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class CollectedFile:
    """One test file: absolute path, requirement, and the ids of its selected tests."""

    path: str
    requirement: Requirement
    tests: tuple[str, ...]
    levels: tuple[Requirement, ...] = ()  # the distinct requirements of its tests
    cached: bool = False  # taken from the collection cache, not collected this time
    seconds: float = 0.0  # how long collecting it took (streamed entries only; 0: unknown)
    deferred: bool = False  # not imported by the collection: its own run collects it


@dataclass(frozen=True)
class CollectError:
    """A file pytest could not collect (syntax error, import error, bad marker)."""

    path: str
    nodeid: str
    message: str


@dataclass
class Collection:
    rootdir: str
    files: list[CollectedFile] = field(default_factory=list)
    errors: list[CollectError] = field(default_factory=list)
    skipped: list[CollectError] = field(default_factory=list)  # whole modules skipped at import
    keys: dict[str, str] = field(default_factory=dict)  # collection-cache key of each good module


def parse_report(payload: dict) -> Collection:
    """The plugin's JSON report as typed records."""
    collection = Collection(rootdir=payload["rootdir"])
    for entry in payload["files"]:
        collection.files.append(
            CollectedFile(
                entry["path"],
                Requirement(entry["gpus"], entry["memory"]),
                tuple(entry["tests"]),
                tuple(Requirement(gpus, memory) for gpus, memory in entry.get("levels", [])),
                bool(entry.get("cached", False)),
                deferred=bool(entry.get("deferred", False)),
            )
        )
    collection.keys = dict(payload.get("keys", {}))
    for entry in payload["errors"]:
        collection.errors.append(CollectError(entry["path"], entry["nodeid"], entry["message"]))
    for entry in payload.get("skipped", []):
        collection.skipped.append(CollectError(entry["path"], entry["nodeid"], entry["message"]))
    return collection


def report_location() -> str:
    """A fresh path for the plugin's report; absent until the plugin wrote it whole."""
    fd, report_path = tempfile.mkstemp(prefix="gpusched-collect-", suffix=".json")
    os.close(fd)
    os.unlink(report_path)  # the plugin writes it atomically; absence means it never finished
    return report_path


def collection_command(
    paths: Sequence[str],
    pytest_args: Sequence[str],
    report_path: str,
    cache: tuple[Path, str] | None,
    extra: Sequence[str] = (),
) -> tuple[list[str], dict[str, str], str]:
    """The collection child's pytest arguments, environment and job tag."""
    tag = f"collect-{uuid.uuid4().hex[:12]}"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env[TAG_VARIABLE] = tag
    args = [
        "--collect-only",
        "-q",
        *plugin_args(),
        f"--gpusched-report={report_path}",
        *(
            [f"--gpusched-cache={cache[0].resolve()}", f"--gpusched-context={cache[1]}"]
            if cache is not None
            else []
        ),
        *extra,
        *pytest_args,
        *paths,
    ]
    return args, env, tag


def timed_out(timeout: float) -> CollectionFailed:
    """The error of a collection that ran past ``--collect-timeout``."""
    return CollectionFailed(
        f"collection timed out after {timeout:g}s (--collect-timeout); "
        "a conftest or test module probably hangs at import",
        exit_code=3,
    )


def read_report(report_path: str, returncode: int, output: str) -> Collection:
    """The finished collection, or CollectionFailed when pytest could not collect at all."""
    if returncode == 4:
        raise CollectionFailed(f"pytest rejected the arguments:\n{output.strip()}", exit_code=4)
    try:
        with open(report_path, encoding="utf-8") as handle:
            payload = json.load(handle)
    except FileNotFoundError:
        raise CollectionFailed(
            f"collection failed (pytest exit code {returncode}):\n{output[-4000:].strip()}",
            exit_code=3,
        ) from None
    return parse_report(payload)


def remove_files(*paths: str) -> None:
    for leftover in paths:
        try:
            os.unlink(leftover)
        except FileNotFoundError:
            pass


def collect(
    paths: Sequence[str],
    pytest_args: Sequence[str],
    timeout: float,
    server: ForkServer | None = None,
    cache: tuple[Path, str] | None = None,
) -> Collection:
    """Run the collection (a child of the fork server, else a subprocess); what it found.

    ``cache`` is the collection cache's path and the runner's context key
    (``gpusched.collection.cache``): files it still describes are not imported.
    """
    report_path = report_location()
    args, env, tag = collection_command(paths, pytest_args, report_path, cache)
    if server is not None:
        try:
            return _collect_forked(server, args, env, tag, report_path, timeout)
        except ServerGone:
            pass  # the server died: collect in a fresh process (the runner falls back too)
    command = [sys.executable, "-m", "pytest", *args]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        process_group=0,
        text=True,
    )
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc.pid, proc.pid, tag, grace=1.0)
            proc.communicate()
            raise timed_out(timeout) from None
        return read_report(report_path, proc.returncode, output)
    finally:
        if proc.poll() is None:  # KeyboardInterrupt while waiting
            kill_job(proc.pid, proc.pid, tag, grace=1.0)
            proc.wait()
        remove_files(report_path, report_path + ".part")


def _collect_forked(
    server: ForkServer,
    args: Sequence[str],
    env: dict[str, str],
    tag: str,
    report_path: str,
    timeout: float,
) -> Collection:
    """Collection in a child of the fork server: pytest, plugins and preloads already imported."""
    log = Path(report_path + ".log")
    pid: int | None = None
    code: int | None = None
    try:
        pid = server.spawn(args, env, log, tag)
        code = server.wait(pid, timeout)
        if code is None:
            kill_job(pid, pid, tag, grace=1.0)
            server.wait(pid, 5.0)
            raise timed_out(timeout)
        if code == SERVER_DIED:
            kill_job(None, pid, tag, grace=1.0)
            raise ServerGone("the fork server exited during collection")
        output = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        return read_report(report_path, code, output)
    finally:
        if pid is not None and code is None:  # KeyboardInterrupt while waiting
            kill_job(pid, pid, tag, grace=1.0)
        remove_files(report_path, report_path + ".part", str(log))
