"""How fast a core of this machine runs now: a fixed piece of work timed in CPU seconds, over time.

A wall-clock figure of a CPU-bound suite follows the machine's speed, which on
a shared virtual machine moves by itself: the same files have cost 35% more
CPU seconds an hour apart here. This probe tells that drift apart from a
change's effect. Every ``--every`` seconds it runs the same pure-Python loop
and records the CPU seconds it took (``time.process_time``: the time this
process ran, so other processes taking turns on the cores do not count,
only how fast the core runs when it is ours). Beside a run, or alone:

    python bench/speed_probe.py --out speed.jsonl &      # until killed
    python bench/speed_probe.py --samples 5              # five now, then a summary

Each sample is a JSON line ``{"t": unix time, "cpu_s": seconds}``; at the end
(``--samples`` reached, SIGTERM or Ctrl-C) it prints the median, the fastest
and the slowest sample. The loop takes about 0.1 s of one core, so one
sample every 10 s costs the machine about 1%.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

LOOP = 1_000_000


def sample() -> float:
    """CPU seconds that ``LOOP`` multiply-adds of Python integers take on this core now."""
    start = time.process_time()
    total = 0
    for i in range(LOOP):
        total += i * i
    return time.process_time() - start


def summary(samples: list[float]) -> str:
    """The median, fastest and slowest sample, in milliseconds."""
    if not samples:
        return "speed_probe: no sample"
    ms = sorted(s * 1000 for s in samples)
    return (
        f"speed_probe: {len(ms)} samples, median {statistics.median(ms):.0f} ms, "
        f"fastest {ms[0]:.0f} ms, slowest {ms[-1]:.0f} ms (slowest/fastest {ms[-1] / ms[0]:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--samples", type=int, default=0, help="stop after this many (0: never)")
    parser.add_argument("--out", type=Path, help="append each sample here as a JSON line")
    args = parser.parse_args(argv)
    if args.every <= 0 or args.samples < 0:
        parser.error("--every must be above 0 and --samples at least 0")
    taken: list[float] = []

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    out = args.out.open("a", encoding="utf-8") if args.out else None
    try:
        while not args.samples or len(taken) < args.samples:
            cpu_s = sample()
            taken.append(cpu_s)
            if out is not None:
                out.write(json.dumps({"t": round(time.time(), 1), "cpu_s": round(cpu_s, 4)}) + "\n")
                out.flush()
            if not args.samples or len(taken) < args.samples:
                time.sleep(args.every)
    except KeyboardInterrupt:
        pass
    finally:
        if out is not None:
            out.close()
        print(summary(taken), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
