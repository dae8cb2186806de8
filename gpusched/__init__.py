"""GPU-aware scheduling of pytest suites: collect, pack onto cards, run, report.

The folders are the stages of a run, and imports point only downwards:

- ``cli``, ``options``, ``session``: the command line and the driver of one run;
- ``collection/``: what each file needs (one pytest ``--collect-only`` child, its cache);
- ``reporting/``: console, live view, JUnit/JSON, HTML timeline;
- ``execution/``: starting, watching and killing real processes on this node's cards
  (the asyncio runner, the fork server, process trees, card release);
- ``scheduling/``: the pure policy (packing, simulation, CI shards, early picks);
- ``requirements``, ``results``, ``inventory``, ``history``, ``atomic``: the records
  every stage shares (what a file needs, what it did, the cards, past durations).

``plugin`` is the pytest side, loaded in every child; nothing imports it.
"""

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
