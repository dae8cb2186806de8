"""Coverage under gpusched: pytest-cov's measurement, kept per file and reported once per run.

A file's pytest process measures as pytest-cov always does, but into a data
directory of its own (``GPUSCHED_COVERAGE_DIR``, with ``COVERAGE_FILE`` in it)
and without reporting (``gpusched.coverage.child``); the run's end combines
every file's data into the user's data file and writes the reports pytest-cov
would have written (``gpusched.coverage.combine``). ``gpusched.coverage.request``
decides, before any file starts, whether the run measures at all.
"""

COVERAGE_DIR_VARIABLE = "GPUSCHED_COVERAGE_DIR"
"""A file's own directory for its coverage data and manifest; set only when a run measures."""

MANIFEST = "gpusched-coverage.json"
"""What a file's process says of its measurement: pytest-cov's options, coverage's version."""

DATA_NAME = ".coverage"
"""The data file's name in each file's directory (``COVERAGE_FILE``)."""
