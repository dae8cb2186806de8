"""Duration history: how long each test file took and the cores it used, learned from every run.

The history lives in ``.gpusched/durations.json``::

    {
      "version": 1,
      "files": {
        "tests/test_model.py": {"seconds": 12.4, "last": 12.9, "runs": 5,
                                "cpu": 1.32, "peak": 2.9},
        ...
      }
    }

Keys are file paths relative to pytest's rootdir (POSIX separators), so the
history is the same on every checkout. ``seconds`` is the expected wall time of
the file's pytest subprocess (an exponential moving average of the runs,
newest weighing ``WEIGHT``), ``last`` the latest run, ``runs`` how many runs were
seen. Packing, ``plan`` and ``shard`` read ``seconds``; files the history does
not know get the mean of those it knows.

``cpu`` is the cores the file's whole process tree used on average (CPU
seconds over wall seconds, Ray workers and ranks included), ``peak`` the most
it used over one sampling interval; both moving averages like ``seconds``.
Packing reads ``cpu`` (``gpusched.scheduling.packing.cpu_demand``). Both are
optional: a file written before they were measured, or by a run that could not
measure them, is read as it is, and each file gets them the next time it runs.

Writers take an exclusive ``fcntl`` lock on ``durations.json.lock``, read,
merge and replace the file atomically, so concurrent runs lose no entry and a
reader never sees half a file. A corrupt file is reported and replaced, never a
crash. The pure functions (parse, merge, expectations) are separate from the
two that touch the disk (``load_history``, ``record_durations``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusched.atomic import atomic_write
from gpusched.results import FileResult, Outcome

HISTORY_FILE = "durations.json"
VERSION = 1
WEIGHT = 0.5  # weight of the newest run in the moving average
DEFAULT_SECONDS = 1.0  # expected duration when the history knows no file at all

# Outcomes whose wall time says how long the file takes. Interrupted, not run and
# skipped files never ran to the end; a timeout is kept: the file takes at least that.
TIMED = frozenset(
    {
        Outcome.PASSED,
        Outcome.FAILED,
        Outcome.FLAKY,
        Outcome.ERROR,
        Outcome.TIMEOUT,
        Outcome.CRASHED,
    }
)


class HistoryError(ValueError):
    """The history file is not what this module writes; the message says what is wrong."""


@dataclass(frozen=True)
class Entry:
    """One file's record: expected seconds (moving average), the last run's seconds, run count;
    its mean and peak CPU use in cores (moving averages; None until it was measured)."""

    seconds: float
    last: float
    runs: int
    cpu: float | None = None
    peak: float | None = None


@dataclass(frozen=True)
class Observation:
    """What one run saw of a file: its wall seconds, and its mean and peak cores if measured."""

    seconds: float
    cpu: float | None = None
    peak: float | None = None


History = dict[str, Entry]


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HistoryError(f"{where} is {value!r}, not a number")
    if not math.isfinite(value) or value < 0:
        raise HistoryError(f"{where} is {value!r}, not a finite non-negative number")
    return float(value)


def parse_history(text: str) -> History:
    """The entries of a durations file; ``HistoryError`` names what is malformed."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HistoryError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HistoryError("top level is not a JSON object")
    if data.get("version") != VERSION:
        raise HistoryError(f"version is {data.get('version')!r}, expected {VERSION}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise HistoryError('"files" is missing or not an object')
    history: History = {}
    for key, record in files.items():
        if not isinstance(record, dict):
            raise HistoryError(f"entry {key!r} is not an object")
        runs = record.get("runs")
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise HistoryError(f"entry {key!r}: runs is {runs!r}, not a positive integer")
        history[key] = Entry(
            _number(record.get("seconds"), f"entry {key!r}: seconds"),
            _number(record.get("last"), f"entry {key!r}: last"),
            runs,
            *(
                None
                if record.get(name) is None
                else _number(record[name], f"entry {key!r}: {name}")
                for name in ("cpu", "peak")
            ),
        )
    return history


def dump_history(history: Mapping[str, Entry]) -> str:
    """The file's text: sorted keys, times and cores rounded to thousandths."""
    files = {}
    for key, entry in sorted(history.items()):
        record: dict[str, float | int] = {
            "seconds": round(entry.seconds, 3),
            "last": round(entry.last, 3),
            "runs": entry.runs,
        }
        if entry.cpu is not None:
            record["cpu"] = round(entry.cpu, 3)
        if entry.peak is not None:
            record["peak"] = round(entry.peak, 3)
        files[key] = record
    return json.dumps({"version": VERSION, "files": files}, indent=2) + "\n"


def _moved(old: float | None, new: float | None) -> float | None:
    """A moving average ``old`` after one more value ``new`` (either may be missing)."""
    if old is None or new is None:
        return new if old is None else old
    return WEIGHT * new + (1 - WEIGHT) * old


def merge(history: Mapping[str, Entry], observed: Mapping[str, Observation]) -> History:
    """``history`` updated with one run's observations (a new dict; the input is untouched).

    A file seen for the first time takes its observed figures; a known file moves
    towards them by ``WEIGHT``. A figure the run did not measure leaves the old
    one as it was; one the history lacks (an older file) is taken as observed.
    """
    merged = dict(history)
    for key, seen in observed.items():
        old = merged.get(key)
        if old is None:
            merged[key] = Entry(seen.seconds, seen.seconds, 1, seen.cpu, seen.peak)
        else:
            merged[key] = Entry(
                WEIGHT * seen.seconds + (1 - WEIGHT) * old.seconds,
                seen.seconds,
                old.runs + 1,
                _moved(old.cpu, seen.cpu),
                _moved(old.peak, seen.peak),
            )
    return merged


def combine(histories: Iterable[Mapping[str, Entry]]) -> History:
    """Several copies of one history, each updated by some runs (CI shards), as one.

    For each file the entry that saw the most runs wins; copies that share an
    ancestor agree on every file none of them ran.
    """
    combined: History = {}
    for history in histories:
        for key, entry in history.items():
            if key not in combined or entry.runs > combined[key].runs:
                combined[key] = entry
    return combined


def history_key(path: str, rootdir: str) -> str:
    """The key of a file: its path relative to ``rootdir`` in POSIX form (absolute if outside)."""
    absolute = os.path.abspath(path)
    try:
        relative = os.path.relpath(absolute, os.path.abspath(rootdir))
    except ValueError:
        return Path(absolute).as_posix()
    if relative.startswith(".."):
        return Path(absolute).as_posix()
    return Path(relative).as_posix()


def with_seed(history: Mapping[str, Entry], seed: Mapping[str, Entry]) -> History:
    """``history`` with the entries of ``seed`` (``--durations-seed``) for the files it lacks."""
    return {**seed, **history}


def expected_durations(history: Mapping[str, Entry], keys: Sequence[str]) -> dict[str, float]:
    """Expected seconds for each key: its history, or the mean of the known ones.

    The mean is taken over the requested files the history knows; if it knows
    none of them, over the whole history; if the history is empty,
    ``DEFAULT_SECONDS``.
    """
    known = [history[key].seconds for key in keys if key in history]
    if not known:
        known = [entry.seconds for entry in history.values()]
    fallback = sum(known) / len(known) if known else DEFAULT_SECONDS
    return {key: history[key].seconds if key in history else fallback for key in keys}


def measured_cpu(history: Mapping[str, Entry], keys: Sequence[str]) -> dict[str, float | None]:
    """Each key's mean CPU use in cores from the history; None where it was never measured.

    No mean of the others stands in for a missing figure: the packing policy
    has its own default for a file never measured (``cpu_demand``).
    """
    return {key: entry.cpu if (entry := history.get(key)) is not None else None for key in keys}


def observations(results: Iterable[FileResult], rootdir: str) -> dict[str, Observation]:
    """The wall time and CPU use of each file that ran to an end, keyed for the history."""
    return {
        history_key(result.path, rootdir): Observation(result.duration, result.cpu, result.cpu_peak)
        for result in results
        if result.outcome in TIMED and result.end > result.start
    }


# ---- effects -------------------------------------------------------------------------


def load_history(path: str | Path) -> tuple[History, str | None]:
    """The history at ``path`` and a warning if it was unreadable (then it counts as empty).

    A missing file is an empty history without a warning.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"cannot read duration history {path}: {exc}; ignoring it"
    try:
        return parse_history(text), None
    except HistoryError as exc:
        return {}, f"duration history {path} is corrupt ({exc}); ignoring it, it will be replaced"


def load_durations(path: str | Path, seed: str | Path | None) -> tuple[History, str | None]:
    """The history at ``path`` filled in from the durations file ``seed``, and a warning.

    ``seed`` was checked when the options were read; a seed that broke since
    then is left out with a warning, like a corrupt history.
    """
    history, warning = load_history(path)
    if seed is None:
        return history, warning
    seeded, seed_warning = load_history(seed)
    return with_seed(history, seeded), warning or seed_warning


def record_durations(path: str | Path, observed: Mapping[str, Observation]) -> str | None:
    """Merge one run's observations into the history at ``path``; returns a warning or None.

    Holds an exclusive lock on ``<path>.lock`` from read to replace, so runs that
    finish at the same time each add their files. A corrupt file is replaced by
    one holding this run's times, and the warning says so.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            history, warning = load_history(target)
            atomic_write(target, dump_history(merge(history, observed)))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return warning


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpusched.history merge -o OUT FILE...``: join the histories of CI shards."""
    parser = argparse.ArgumentParser(prog="python -m gpusched.history")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("merge", help="combine durations files written by parallel runs")
    join.add_argument("files", nargs="+", help="durations.json files (missing ones are skipped)")
    join.add_argument("-o", "--output", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    histories = []
    for name in args.files:
        history, warning = load_history(name)
        if warning:
            print(f"gpusched: warning: {warning}", file=sys.stderr)
        histories.append(history)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    combined = combine(histories)
    atomic_write(output, dump_history(combined))
    print(f"gpusched: {len(combined)} files in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
