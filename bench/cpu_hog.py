"""Run a command with busy processes beside it: the suite under load, as on a shared machine.

    python bench/cpu_hog.py --procs 2 -- bash .ci/run

Starts ``--procs`` processes that spin on the CPU, runs the command in a
process group of its own, stops the hog whatever happens, and prints the command's wall time
and exit code; exits with the command's code. The hog is plain Python
arithmetic in a loop, so it takes a core each and nothing else. Ctrl-C or
SIGTERM is passed on to the command's whole group (gpusched then stops its
files and reports), which gets ``--grace`` seconds before SIGKILL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the command's process group; SIGKILL to it after ``grace`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="busy processes (default 2)")
    p.add_argument("--grace", type=float, default=60.0, help="seconds before SIGKILL (60)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.procs < 1:
        p.error(f"--procs {args.procs}: must be >= 1")
    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop the command and the hog.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.procs)]
    for h in hogs:
        h.start()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(command, process_group=0)
        try:
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                _stop(proc, args.grace)
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()
    print(
        f"cpu_hog: {args.procs} busy processes; {' '.join(command)}: exit {rc} in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
