"""The collection cache: files that did not change since the last run are not collected again.

Collection imports every test module once more before anything runs; on a
suite whose slow files are slow to collect (click's 30,000 deselected stress
tests), that doubles their cost. The cache, ``.gpusched/collection.json``,
remembers what the last collection found for each file::

    {"version": 1, "files": {"tests/test_x.py": {"key": "...", "gpus": 0,
     "memory": null, "tests": ["tests/test_x.py::test_a"], "levels": [[0, null]]}}}

A file's key hashes its bytes, the bytes of every ``conftest.py`` in its
directory and above, the ini file and ``pyproject.toml`` (markers by glob), the
arguments that select tests, and the versions of Python, pytest and gpusched.
When the collection child finds the key unchanged it does not import the file
(``gpusched.plugin``) and reports the cached entry instead.

A key cannot see everything: a helper module the test file imports may define
its markers. So a cached entry is a prediction that the file's own child
checks: each child gets ``--gpusched-expect=GPUS:MEMORY:TESTS_HASH`` and, after
its own collection, compares. A different test list is streamed back and
replaces the cached one; a different requirement also stops the child before
any test runs (``EXIT_RECOLLECTED``), and the runner queues the file again on
the cards it really needs.

Pure functions here; the plugin hashes, the session loads and saves.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusched import __version__
from gpusched.atomic import atomic_write
from gpusched.requirements import Requirement

CACHE_FILE = "collection.json"
VERSION = 1


@dataclass(frozen=True)
class CachedFile:
    """What the last collection found for one file, and the key it was found under."""

    key: str
    requirement: Requirement
    tests: tuple[str, ...]
    levels: tuple[Requirement, ...]


def context_key(args: Sequence[str], addopts: str | None) -> str:
    """The part of every key that the runner knows: selection arguments and ``PYTEST_ADDOPTS``."""
    return _digest(json.dumps([list(args), addopts or ""]))


def base_key(context: str, pytest_version: str, *config_files: bytes | None) -> str:
    """The part of every key shared by a session's files: context, versions, ini and pyproject."""
    parts = [context, __version__, pytest_version, sys.version]
    parts += ["" if data is None else _digest_bytes(data) for data in config_files]
    return _digest("\0".join(parts))


def file_key(base: str, source: bytes, conftests: Iterable[bytes]) -> str:
    """One file's key: the session's base, its bytes and its conftests' bytes."""
    digest = hashlib.sha256(base.encode())
    for data in (source, *conftests):
        digest.update(_digest_bytes(data).encode())
    return digest.hexdigest()[:32]


def conftest_chain(path: Path) -> list[Path]:
    """The ``conftest.py`` files pytest may load for ``path``: its directory and every one above."""
    found = []
    for directory in path.resolve().parents:
        candidate = directory / "conftest.py"
        if candidate.is_file():
            found.append(candidate)
    return found


def parse_cache(payload: object) -> dict[str, CachedFile]:
    """Entries by path relative to the rootdir; anything malformed is dropped, never an error."""
    if not isinstance(payload, dict) or payload.get("version") != VERSION:
        return {}
    files = payload.get("files")
    if not isinstance(files, dict):
        return {}
    entries = {}
    for path, entry in files.items():
        try:
            entries[path] = CachedFile(
                str(entry["key"]),
                Requirement(int(entry["gpus"]), entry["memory"]),
                tuple(str(test) for test in entry["tests"]),
                tuple(Requirement(int(g), m) for g, m in entry["levels"]),
            )
        except (KeyError, TypeError, ValueError):
            continue
    return entries


def entry_json(entry: CachedFile) -> dict:
    """An entry as the collection report and the cache file write it (without its key)."""
    return {
        "gpus": entry.requirement.gpus,
        "memory": entry.requirement.memory,
        "tests": list(entry.tests),
        "levels": [[level.gpus, level.memory] for level in entry.levels],
    }


def cache_payload(entries: Mapping[str, CachedFile]) -> dict:
    return {
        "version": VERSION,
        "files": {
            path: {"key": entry.key, **entry_json(entry)} for path, entry in sorted(entries.items())
        },
    }


def load_cache(path: Path) -> dict[str, CachedFile]:
    """The cache on disk; empty when absent or unreadable (it is only a cache)."""
    try:
        return parse_cache(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def save_cache(path: Path, entries: Mapping[str, CachedFile], rootdir: Path) -> None:
    """Write ``entries``, dropping files that no longer exist."""
    alive = {rel: entry for rel, entry in entries.items() if (rootdir / rel).is_file()}
    atomic_write(path, json.dumps(cache_payload(alive), separators=(",", ":")))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remembered(
    entries: Mapping[str, CachedFile],
    files: Iterable[tuple[str, CachedFile]],
    empty: Iterable[tuple[str, str]],
    rootdir: Path,
) -> dict[str, CachedFile]:
    """``entries`` updated with this collection's ``files`` and its modules without selected tests.

    Paths come in absolute and are stored relative to ``rootdir``; files outside
    it are not cached.
    """
    updated = dict(entries)
    for path, entry in [
        *files,
        *((path, CachedFile(key, Requirement(), (), ())) for path, key in empty),
    ]:
        relative = relative_key(path, rootdir)
        if relative is not None:
            updated[relative] = entry
    return updated


def relative_key(path: str | Path, rootdir: str | Path) -> str | None:
    """A cache entry's name: ``path`` relative to ``rootdir`` (both resolved), POSIX; None outside."""
    try:
        return Path(path).resolve().relative_to(Path(rootdir).resolve()).as_posix()
    except ValueError:
        return None
