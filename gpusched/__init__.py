"""GPU-aware scheduling of pytest suites: collect, pack onto cards, run, report."""

from pathlib import Path

__version__ = "0.1.0"

# gpusched's exit codes (DESIGN.md): pytest's, plus 3 for an internal error.
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INTERNAL, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3, 4, 5

STATE_DIR = Path(".gpusched")  # history, collection cache, logs: relative to where gpusched runs
