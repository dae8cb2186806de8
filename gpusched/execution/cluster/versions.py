"""What must be the same on every node of a run: interpreter, pytest, gpusched, pytest plugins.

Each agent reports ``local_versions()`` of its node; the driver compares them
with its own and refuses to run on a node that differs, naming the node and
the difference (``differences``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path

import gpusched

# A JSON object whose entries replace what this node reports; only for testing the check.
OVERRIDE_VARIABLE = "GPUSCHED_VERSION_OVERRIDE"


def source_digest(package: Path | None = None) -> str:
    """A short hash of gpusched's own source files: catches two checkouts with one version number."""
    root = package or Path(gpusched.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def local_versions() -> dict[str, str]:
    """This process's versions, by name (``python``, ``pytest``, ``gpusched``, ``plugin NAME``)."""
    versions = {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "pytest": _version("pytest"),
        "gpusched": gpusched.__version__,
        "gpusched source": source_digest(),
    }
    for entry in metadata.entry_points(group="pytest11"):
        dist = entry.dist
        if dist is not None and dist.name != gpusched.DISTRIBUTION:
            versions[f"plugin {dist.name}"] = dist.version
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        try:
            versions.update({str(k): str(v) for k, v in json.loads(override).items()})
        except (ValueError, AttributeError):
            raise ValueError(f"{OVERRIDE_VARIABLE}={override!r} is not a JSON object") from None
    return versions


def differences(here: dict[str, str], there: dict[str, str]) -> list[str]:
    """One line per name whose version differs: ``pytest 8.3.1 here, 8.2.0 there``."""
    lines = []
    for name in sorted(set(here) | set(there)):
        mine, theirs = here.get(name, "missing"), there.get(name, "missing")
        if mine != theirs:
            lines.append(f"{name} {mine} here, {theirs} there")
    return lines


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "missing"
