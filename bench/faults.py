"""Run every fault injection of tests/gpusched/faults against real processes and print a table.

    python bench/faults.py            # all injections
    python bench/faults.py kills      # only some (names from scenarios.ALL)

Each row: the fault, the expected outcome, the observed outcome (computed from
the run's JSON report, exit code and output), and the processes and temporary
files left behind (scanned by an environment mark and by listing the run's
TMPDIR). Exit status 1 if any row is not as expected.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpusched" / "faults"))

import scenarios  # noqa: E402


def main(argv: list[str]) -> int:
    wanted = set(argv)
    unknown = wanted - {name for name, _ in scenarios.ALL}
    if unknown:
        names = ", ".join(name for name, _ in scenarios.ALL)
        print(f"unknown injection(s) {', '.join(sorted(unknown))}; choose from {names}")
        return 2
    rows = []
    started = time.monotonic()
    for name, run in scenarios.ALL:
        if wanted and name not in wanted:
            continue
        t0 = time.monotonic()
        for observation in run():
            rows.append((observation, time.monotonic() - t0))
    header = ("fault", "expected", "observed", "as expected", "procs left", "temp left", "s")
    table = [
        (
            o.fault,
            o.expected,
            o.observed,
            "yes" if o.observed == o.expected else "NO",
            str(len(o.processes_left)),
            str(len(o.temp_left)),
            f"{seconds:.1f}",
        )
        for o, seconds in rows
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    bad = [o for o, _ in rows if not o.ok]
    print(
        f"\n{len(rows)} injections, {len(rows) - len(bad)} as expected with nothing left behind, "
        f"{time.monotonic() - started:.0f}s"
    )
    for o in bad:
        print(
            f"NOT OK: {o.fault}: observed {o.observed!r}; processes {o.processes_left}; "
            f"temp {o.temp_left}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
