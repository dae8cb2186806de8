"""CI sharding by GPU count: which files a runner with N cards runs (pure).

A *runner class* is a kind of CI runner, named by its card count. Sorted
sizes ``s0 < s1 < ...`` give the classes ``[0, s0]``, ``(s0, s1]``, ...: a
runner with ``s_i`` cards runs the files needing more cards than the next
smaller class has, up to its own count. With sizes 0, 1, 2, 8 the classes are
CPU files, 1-GPU files, 2-GPU files and 3- to 8-GPU files. By default the
sizes are the GPU counts found in the suite itself. Files needing more cards
than the largest runner has go to the largest class, where gpusched skips
the tests that need too many cards, with the reason: every file lands in
exactly one class.

Within a class, files are spread over K shards by expected duration: longest
first, each into the least loaded shard (ties: lowest shard, then path), so the
shards finish close together. Every runner computes the same split from the
same suite and history; nothing is exchanged between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class ShardError(ValueError):
    """A sharding request that cannot be met; the message names the bad input."""


@dataclass(frozen=True)
class SuiteFile:
    """A file of the suite: its history key, the cards it needs, its expected seconds."""

    key: str
    gpus: int
    expected: float


@dataclass(frozen=True)
class RunnerClass:
    """Runners with ``gpus`` cards; they run files needing ``low`` to ``gpus`` cards."""

    gpus: int
    low: int

    @property
    def name(self) -> str:
        return "cpu" if self.gpus == 0 else f"gpu{self.gpus}"

    def describe(self) -> str:
        span = str(self.gpus) if self.low == self.gpus else f"{self.low}-{self.gpus}"
        return f"files needing {span} GPUs"


@dataclass(frozen=True)
class MatrixEntry:
    """One CI job: shard ``index`` of ``shards`` of a runner class."""

    runner: RunnerClass
    index: int
    shards: int
    files: tuple[str, ...]
    expected: float

    def to_json(self, sizes: Sequence[int]) -> dict:
        return {
            "name": f"{self.runner.name}-{self.index + 1}of{self.shards}",
            "gpus": self.runner.gpus,
            "index": self.index,
            "shards": self.shards,
            "runner_sizes": ",".join(str(size) for size in sizes),
            "files": len(self.files),
            "expected_seconds": round(self.expected, 1),
        }


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"0,1,2,8"`` -> (0, 1, 2, 8); ``ShardError`` for anything else."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ShardError(f"--runner-sizes {text!r}: expected card counts such as 0,1,2,8") from None
    if not sizes:
        raise ShardError(f"--runner-sizes {text!r}: names no runner size")
    if any(size < 0 for size in sizes):
        raise ShardError(f"--runner-sizes {text!r}: a card count is negative")
    if len(set(sizes)) != len(sizes):
        raise ShardError(f"--runner-sizes {text!r}: a size is named twice")
    return tuple(sorted(sizes))


def runner_classes(sizes: Iterable[int]) -> list[RunnerClass]:
    """The classes served by runners of these card counts, smallest first."""
    ordered = sorted(set(sizes))
    if not ordered:
        raise ShardError("no runner sizes: the suite is empty and --runner-sizes was not given")
    classes = [RunnerClass(ordered[0], 0)]
    classes += [RunnerClass(size, low + 1) for low, size in zip(ordered, ordered[1:], strict=False)]
    return classes


def suite_sizes(files: Iterable[SuiteFile]) -> tuple[int, ...]:
    """Default runner sizes: the distinct GPU counts of the suite."""
    return tuple(sorted({file.gpus for file in files}))


def class_of(gpus: int, classes: Sequence[RunnerClass]) -> RunnerClass:
    """The class that runs a file needing ``gpus`` cards (the largest one if none is big enough)."""
    for runner in classes:
        if runner.low <= gpus <= runner.gpus:
            return runner
    return classes[-1]


def oversized(files: Iterable[SuiteFile], classes: Sequence[RunnerClass]) -> list[SuiteFile]:
    """Files needing more cards than the largest runner has (their big tests skip there)."""
    return [file for file in files if file.gpus > classes[-1].gpus]


def balance(files: Sequence[SuiteFile], shards: int) -> list[list[SuiteFile]]:
    """Split ``files`` into ``shards`` lists: longest first into the least loaded shard."""
    if shards < 1:
        raise ShardError(f"--shards {shards}: must be at least 1")
    loads = [0.0] * shards
    bins: list[list[SuiteFile]] = [[] for _ in range(shards)]
    for file in sorted(files, key=lambda f: (-f.expected, f.key)):
        target = min(range(shards), key=lambda i: (loads[i], i))
        bins[target].append(file)
        loads[target] += file.expected
    return [sorted(group, key=lambda f: f.key) for group in bins]


def select(
    files: Sequence[SuiteFile],
    classes: Sequence[RunnerClass],
    gpus_per_runner: int,
    shards: int = 1,
    index: int = 0,
) -> list[SuiteFile]:
    """The files of shard ``index`` (0-based) of ``shards`` for a runner with ``gpus_per_runner`` cards."""
    by_size = {runner.gpus: runner for runner in classes}
    if gpus_per_runner not in by_size:
        raise ShardError(
            f"--gpus-per-runner {gpus_per_runner}: no runner class has that many cards "
            f"(classes: {','.join(str(size) for size in by_size)}; set them with --runner-sizes)"
        )
    if shards < 1:
        raise ShardError(f"--shards {shards}: must be at least 1")
    if not 0 <= index < shards:
        raise ShardError(f"--index {index}: must be in 0..{shards - 1} for --shards {shards}")
    runner = by_size[gpus_per_runner]
    members = [file for file in files if class_of(file.gpus, classes) == runner]
    return balance(members, shards)[index]


def matrix(
    files: Sequence[SuiteFile], classes: Sequence[RunnerClass], max_shards: int = 1
) -> list[MatrixEntry]:
    """Every CI job: each non-empty class split into ``min(max_shards, its files)`` shards."""
    if max_shards < 1:
        raise ShardError(f"--shards {max_shards}: must be at least 1")
    entries = []
    for runner in classes:
        members = [file for file in files if class_of(file.gpus, classes) == runner]
        if not members:
            continue
        count = min(max_shards, len(members))
        for index, group in enumerate(balance(members, count)):
            entries.append(
                MatrixEntry(
                    runner,
                    index,
                    count,
                    tuple(file.key for file in group),
                    sum(file.expected for file in group),
                )
            )
    return entries
