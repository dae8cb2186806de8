"""GPU-aware scheduling of pytest suites: collect, pack onto cards, run, report."""

__version__ = "0.1.0"
