"""This repository's coverage as ``.ci/run`` measures it, with and without what Ray workers and
ranks ran.

Reads the data file a measuring run left (``.coverage`` after ``bash .ci/run``)
and prints, for the three packages together and for ``trainer/workers/`` on its
own, the percentage of statements covered counting every process, and counting
only the test files' own processes: the lines that only Ray workers, ranks and
submitted jobs ran carry rl_e2e's static context (``rl_e2e.coverage.WORKER_CONTEXT``)
and are left out of the second figure. Both come from one run, side by side.

    python bench/coverage_figures.py [--data-file .coverage]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rl_e2e.coverage import WORKER_CONTEXT  # noqa: E402

PARTS = {
    "gpusched/, trainer/, rl_e2e/": ["*/gpusched/*", "*/trainer/*", "*/rl_e2e/*"],
    "trainer/": ["*/trainer/*"],
    "trainer/workers/": ["*/trainer/workers/*"],
    "rl_e2e/": ["*/rl_e2e/*"],
}
TEST_PROCESSES = [f"^(?!.*{WORKER_CONTEXT})"]  # every context but the workers'


def percent(cov: coverage.Coverage, include: list[str], contexts: list[str] | None) -> float:
    return cov.report(include=include, contexts=contexts, file=io.StringIO(), ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-file", default=str(ROOT / ".coverage"))
    args = parser.parse_args()
    cov = coverage.Coverage(data_file=args.data_file, config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    print(f"{'what':<32} {'all processes':>14} {'test processes only':>20} {'difference':>11}")
    for name, include in PARTS.items():
        everywhere = percent(cov, include, None)
        alone = percent(cov, include, TEST_PROCESSES)
        print(f"{name:<32} {everywhere:>13.1f}% {alone:>19.1f}% {everywhere - alone:>+10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
