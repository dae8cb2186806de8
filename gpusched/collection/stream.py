"""Streaming collection: each file's entry reaches the scheduler as soon as pytest collected it.

The same collection child as ``gpusched.collection.collect`` (same arguments,
same report at the end), with ``--gpusched-stream``: the plugin appends one
JSON line per file (its entry, its collection error, or its module-level skip)
as pytest finishes collecting it. This module tails that file while the child
runs and hands each line on as a typed event, so files start while the slow
ones are still being imported. The final report stays the truth; the session
reconciles the two when the child is done.

Every temporary file is removed on every path (timeout, cancellation, error),
and a child that is still running when we leave is killed as a tree.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpusched.collection.collect import (
    CollectedFile,
    CollectError,
    Collection,
    collection_command,
    read_report,
    remove_files,
    report_location,
    timed_out,
)
from gpusched.execution.forkclient import SERVER_DIED, ForkedProcess, ServerGone
from gpusched.execution.proctree import kill_job
from gpusched.requirements import Requirement

if TYPE_CHECKING:
    from gpusched.execution.forkclient import ForkServer

POLL = 0.02  # seconds between looks at the stream while the child runs


@dataclass(frozen=True)
class Rooted:
    """The collection's rootdir, known before any file (history keys need it)."""

    rootdir: str


@dataclass(frozen=True)
class FileFound:
    """A file collected, with the tests ``-k``/``-m`` will select: a prediction its child checks."""

    file: CollectedFile


@dataclass(frozen=True)
class FileFailed:
    """A file pytest could not collect."""

    error: CollectError


@dataclass(frozen=True)
class FileSkipped:
    """A file skipped as a whole at import (``pytest.skip(allow_module_level=True)``)."""

    skip: CollectError


@dataclass(frozen=True)
class StreamOff:
    """Streaming cannot be trusted for this suite: wait for the final report."""

    reason: str


StreamEvent = Rooted | FileFound | FileFailed | FileSkipped | StreamOff


def parse_line(line: str) -> StreamEvent | None:
    """One line of the plugin's stream as an event; None for a line it does not know."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    match record.get("event"):
        case "start":
            return Rooted(record["rootdir"])
        case "file":
            return FileFound(
                CollectedFile(
                    record["path"],
                    Requirement(record["gpus"], record["memory"]),
                    tuple(record["tests"]),
                    tuple(Requirement(gpus, memory) for gpus, memory in record["levels"]),
                    bool(record.get("cached", False)),
                    float(record.get("seconds", 0.0)),
                    bool(record.get("deferred", False)),
                )
            )
        case "error":
            return FileFailed(CollectError(record["path"], record["nodeid"], record["message"]))
        case "skipped":
            return FileSkipped(CollectError(record["path"], record["nodeid"], record["message"]))
        case "off":
            return StreamOff(record["reason"])
    return None


class _Tail:
    """The complete lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


async def collect_streaming(
    paths: Sequence[str],
    pytest_args: Sequence[str],
    timeout: float,
    on_event: Callable[[StreamEvent], None],
    server: ForkServer | None = None,
    cache: tuple[Path, str] | None = None,
    defer: bool = False,
) -> Collection:
    """Collect like ``collect``, calling ``on_event`` for each file as it is collected.

    ``defer`` (needs ``cache``): files the cache does not know are not imported
    either; they stream as deferred entries, and each one's own run collects it.
    ``server`` must be attached to the running loop. If it dies mid-way, the
    collection runs again in a fresh process: ``on_event`` may then hear a file
    twice. Cancelling kills the child. Raises CollectionFailed like ``collect``.
    """
    report_path = report_location()
    stream = Path(report_path + ".stream")
    log = Path(report_path + ".log")
    extra = [f"--gpusched-stream={stream}", *(["--gpusched-defer"] if defer else [])]
    args, env, tag = collection_command(paths, pytest_args, report_path, cache, extra)
    tail = _Tail(stream)
    proc: ForkedProcess | asyncio.subprocess.Process | None = None
    try:
        if server is not None:
            try:
                proc = await server.start(args, env, log, tag)
            except ServerGone:
                proc = None
        if proc is None:
            with open(log, "wb") as output:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "pytest",
                    *args,
                    stdout=output,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    env=env,
                    process_group=0,
                )
        code = await _follow(proc, tail, on_event, timeout, tag)
        if code == SERVER_DIED and isinstance(proc, ForkedProcess):
            await asyncio.to_thread(kill_job, None, proc.pid, tag, 1.0)
            return await collect_streaming(
                paths, pytest_args, timeout, on_event, None, cache, defer
            )
        output = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        return read_report(report_path, code, output)
    finally:
        if proc is not None and proc.returncode is None:  # cancelled, or timed out
            await asyncio.shield(asyncio.to_thread(kill_job, proc.pid, proc.pid, tag, 1.0))
        remove_files(report_path, report_path + ".part", str(stream), str(log))


async def _follow(
    proc: ForkedProcess | asyncio.subprocess.Process,
    tail: _Tail,
    on_event: Callable[[StreamEvent], None],
    timeout: float,
    tag: str,
) -> int:
    """Hand on the stream's events until the child exits; its exit code."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waiter = asyncio.ensure_future(proc.wait())
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=POLL)
            for line in tail.read():
                event = parse_line(line)
                if event is not None:
                    on_event(event)
            if done:
                return waiter.result()
            if loop.time() > deadline:
                await asyncio.to_thread(kill_job, proc.pid, proc.pid, tag, 1.0)
                await proc.wait()
                raise timed_out(timeout)
    finally:
        waiter.cancel()
