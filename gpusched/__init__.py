"""GPU-aware scheduling of pytest suites: collect, pack onto cards, run, report."""

from importlib import metadata
from pathlib import Path

DISTRIBUTION = "pytest-gpusched"  # gpusched and trainer ship in it, under one version

try:
    # One source of truth: pyproject.toml's version, as installed (setup.sh installs editable;
    # after changing pyproject.toml's version, run setup.sh again to refresh it).
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

# gpusched's exit codes (DESIGN.md): pytest's, plus 3 for an internal error.
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INTERNAL, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3, 4, 5

STATE_DIR = Path(".gpusched")  # history, collection cache, logs: relative to where gpusched runs
