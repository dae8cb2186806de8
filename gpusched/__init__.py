"""GPU-aware scheduling of pytest suites: collect, pack onto cards, run, report."""

from pathlib import Path

__version__ = "0.1.0"

STATE_DIR = Path(".gpusched")  # history, collection cache, logs: relative to where gpusched runs
