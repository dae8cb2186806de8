"""Where a measuring run keeps its coverage data: one folder per attempt of a file.

``ROOT/KEY/`` holds what one pytest process (and whatever it started: Ray
workers, ranks, subprocesses that measure too) wrote: ``.coverage`` and
``.coverage.*`` data files and the process's manifest. Nothing here imports
coverage: the folders are made and moved (``--ray``: from a node to the driver)
as plain files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.coverage import COVERAGE_DIR_VARIABLE, DATA_NAME, MANIFEST


def coverage_env(folder: Path) -> dict[str, str]:
    """The variables that send one attempt's measurement to its own folder (made here)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"COVERAGE_FILE": str(folder / DATA_NAME), COVERAGE_DIR_VARIABLE: str(folder)}


def data_files(folder: Path) -> list[Path]:
    """The coverage data files in an attempt's folder, in a stable order."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [
        folder / name
        for name in names
        if (name == DATA_NAME or name.startswith(DATA_NAME + ".")) and not name.endswith("-journal")
    ]


def pack(folder: Path) -> dict[str, bytes]:
    """An attempt's folder as name -> bytes, to send to the driver (``--ray``); {} if empty."""
    packed = {}
    for path in [*data_files(folder), folder / MANIFEST]:
        try:
            packed[path.name] = path.read_bytes()
        except OSError:
            continue
    return packed


def unpack(files: dict[str, bytes], folder: Path) -> None:
    """Write a packed attempt (``pack``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if os.path.basename(name) != name or not name:
            continue  # only plain names: a node never writes outside the folder
        (folder / name).write_bytes(content)


@dataclass
class Attempt:
    """One attempt's folder, as the run's end finds it."""

    folder: Path
    manifest: dict[str, Any] | None
    files: list[Path] = field(default_factory=list)
    node: str = ""  # the node it ran on (``--ray``); its paths are that node's

    @property
    def file(self) -> str:
        return (self.manifest or {}).get("file", "")


def attempts(root: Path, node: str = "") -> list[Attempt]:
    """Every attempt folder under ``root`` (``root/NODE/KEY`` where ``node`` is ``*``)."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for folder in entries:
        if not folder.is_dir():
            continue
        if node == "*":
            found += attempts(folder, folder.name)
            continue
        found.append(Attempt(folder, read_manifest(folder), data_files(folder), node))
    return found


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
