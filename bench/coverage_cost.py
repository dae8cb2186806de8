"""What measuring coverage costs a gpusched run of this repository's heaviest test files.

Runs the same files through ``gpusched run`` (two simulated cards, as ``.ci/run``)
without coverage and with the coverage ``.ci/run`` can report
(``-- --cov=gpusched --cov=trainer --cov=rl_e2e``: test processes, Ray workers,
ranks and jobs), in turn, the order reversed every round, and prints each
wall, the ratio per round and the ratio of the sums. Every run is a first run
as in CI: the duration history is set aside before each and put back at the
end, so both see the same order (from ``ci/durations.json``). Target: at most
1.15x.

    python bench/coverage_cost.py                       # the 6 longest files, 2 rounds
    python bench/coverage_cost.py --longest 4 --rounds 1
    python bench/coverage_cost.py --files tests/trainer/test_async_rl.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUSCHED = [sys.executable, "-m", "gpusched", "run", "--simulate-gpus", "2", "--timeout", "1800"]
COVERAGE = ["--", "--cov=gpusched", "--cov=trainer", "--cov=rl_e2e", "--cov-report="]
HISTORY = ROOT / ".gpusched" / "durations.json"


def longest(count: int) -> list[str]:
    """The ``count`` files that took longest in the CI order seed (that still exist)."""
    files = json.loads((ROOT / "ci" / "durations.json").read_text())["files"]
    ranked = sorted(files, key=lambda name: -files[name]["seconds"])
    return [name for name in ranked if (ROOT / name).exists()][:count]


def run(files: list[str], measured: bool) -> tuple[float, str]:
    """One first run of ``files``: its wall in seconds and its summary line."""
    HISTORY.unlink(missing_ok=True)
    (ROOT / ".coverage").unlink(missing_ok=True)
    began = time.monotonic()
    done = subprocess.run(
        [*GPUSCHED, *files, *(COVERAGE if measured else [])],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.monotonic() - began
    summary = [line for line in done.stdout.splitlines() if line.startswith("gpusched: ")]
    if done.returncode != 0:
        sys.exit(f"gpusched exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return wall, summary[-1] if summary else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", help="test files (default: --longest)")
    parser.add_argument("--longest", type=int, default=6, help="the N longest files of the seed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    files = args.files or longest(args.longest)
    print(f"files: {' '.join(files)}")
    walls: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as kept:
        saved = Path(kept) / "durations.json"
        if HISTORY.exists():
            shutil.copy2(HISTORY, saved)
        try:
            for index in range(args.rounds):
                order = (False, True) if index % 2 == 0 else (True, False)
                for measured in order:
                    wall, summary = run(files, measured)
                    walls[measured].append(wall)
                    label = "with coverage   " if measured else "without coverage"
                    print(f"round {index + 1} {label} {wall:7.1f} s  {summary}", flush=True)
                ratio = walls[True][-1] / walls[False][-1]
                print(f"round {index + 1} ratio {ratio:.3f}x", flush=True)
        finally:
            HISTORY.unlink(missing_ok=True)
            if saved.exists():
                shutil.copy2(saved, HISTORY)
    total = sum(walls[True]) / sum(walls[False])
    print(f"coverage cost over {args.rounds} round(s): {total:.3f}x (target <= 1.15x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
