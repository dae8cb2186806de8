"""Early starts: the longest files the history knows begin while collection still runs.

Collection is one more pytest session before anything runs; on a suite whose
longest file is also slow to collect (click's 30,000 deselected stress tests)
it doubles that file's cost. So, on a machine where every file is a CPU file
(no card: then no file waits for cards it might need), the fork server starts
the files the duration history says take longest, up to ``cpu_slots - 1``
(collection keeps one core), before collection begins. When collection is
done each is either adopted by the runner (its file was collected: it holds
one CPU slot and reports as usual) or killed and forgotten (the file is gone,
deselected, or failed to collect: collection reports it).

Pure choice here; the session starts and reconciles them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpusched.history import Entry

MIN_SECONDS = 0.5  # a file shorter than this gains nothing from starting early


def early_picks(
    history: Mapping[str, Entry],
    rootdir: Path,
    paths: Sequence[str],
    slots: int,
    is_file: Callable[[Path], bool] = Path.is_file,
) -> list[str]:
    """Absolute paths of the longest known files under ``paths``, at most ``slots - 1``.

    Nothing when a path names tests inside a file (``file::test``): then
    whole files are not what runs.
    """
    if slots < 2 or any("::" in path for path in paths):
        return []
    roots = [Path(path).resolve() for path in paths or ["."]]
    chosen: list[str] = []
    for key, entry in sorted(history.items(), key=lambda item: (-item[1].seconds, item[0])):
        if len(chosen) >= slots - 1 or entry.seconds < MIN_SECONDS:
            break
        path = (rootdir / key).resolve()
        inside = any(path == root or root in path.parents for root in roots)
        if inside and path.name.endswith(".py") and is_file(path):
            chosen.append(str(path))
    return chosen
