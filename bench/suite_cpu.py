"""Where a test run's CPU goes: core-seconds by kind of process (Ray workers, Ray's own, ranks...).

On a 2-core machine a suite of RL test files is bound by CPU, not by waiting,
so its wall follows the CPU it spends; this says which processes spend it.
Runs a command (default: this repository's suite under ``gpusched run``, as
``.ci/run`` does, without coverage) while sampling every process on the
machine with psutil, then prints, per kind, the CPU the processes of that kind
used (their own user + system time, children apart), how many there were and
the mean per process, beside the CPU the whole machine spent in that time
(``/proc/stat``): the difference is what the sampling missed (processes that
lived less than one interval) and what ran beside the command.

    python bench/suite_cpu.py                                   # the whole suite
    python bench/suite_cpu.py -- gpusched run tests/trainer/test_async_rl.py --simulate-gpus 2
    python bench/suite_cpu.py --interval 0.5 -- python -m trainer trainer.total_steps=2
    python bench/suite_cpu.py --dump procs.json    # every process, its parent and its CPU
    python bench/suite_cpu.py --only-mine -- ...      # beside other work: the command's own only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [sys.executable, "-m", "gpusched", "run", "tests", "--simulate-gpus", "2"]

MARK_VARIABLE = "SUITE_CPU_MARK"  # --only-mine: the command's processes inherit it

#: Ray's own processes, by a piece of their command line, and the kind they count as.
RAY_SYSTEM = {
    "gcs_server": "ray: gcs_server",
    "raylet": "ray: raylet",
    "dashboard/dashboard.py": "ray: dashboard",
    "dashboard/agent.py": "ray: dashboard agent",
    "log_monitor.py": "ray: log_monitor",
    "autoscaler/_private/monitor.py": "ray: autoscaler monitor",
    "runtime_env/agent": "ray: runtime env agent",
    "ray.util.client.server": "ray: client server",
}


def kind_of(cmdline: str) -> str:
    """The kind of process a command line belongs to (a row of the table)."""
    if cmdline.startswith("ray::"):
        # "ray::WorkerHost.timed_call": the actor class, whatever method it runs now
        name = cmdline.split()[0][len("ray::") :].split(".")[0]
        if name == "DashboardAgent":
            return "ray: dashboard agent"
        if name == "RuntimeEnvAgent":
            return "ray: runtime env agent"
        return "ray worker: idle" if name == "IDLE" else f"ray worker: {name}"
    program = Path(cmdline.split(" ", 1)[0]).name
    if program in ("cc1plus", "g++", "gcc", "c++", "ld", "as", "cc1"):
        return "C++ compiler (torch inductor)"
    for piece, kind in RAY_SYSTEM.items():
        if piece in cmdline:
            return kind
    if "rl_e2e.reaper" in cmdline:
        return "rl_e2e reaper"
    if "worker_zygote.py" in cmdline:  # a forked worker keeps it until Ray names the process
        return "warm processes (rl_e2e, workers forked from them)"
    if "worker_shim.py" in cmdline:
        return "ray worker: shim"
    if "default_worker.py" in cmdline:
        return "ray worker: starting"
    if "multiprocessing.spawn" in cmdline or "multiprocessing.forkserver" in cmdline:
        return "spawned (e2e_distributed ranks, vLLM)"
    if "gpusched/execution/forkserver" in cmdline or "gpusched.execution.forkserver" in cmdline:
        return "test files (gpusched fork server)"
    if re.search(r"-m gpusched|bin/gpusched", cmdline):
        return "gpusched"
    if re.search(r"-m pytest|bin/pytest|pytest ", cmdline):
        return "pytest"
    if "-m trainer" in cmdline:
        return "python -m trainer"
    if "ray job" in cmdline or "bin/ray " in cmdline:
        return "ray CLI"
    if "python" in cmdline:
        return "other python"
    return "other"


@dataclass
class Seen:
    """One process as last sampled: its own CPU seconds and its most telling command line."""

    cpu: float
    cmdline: str
    ppid: int = 0


def _telling(old: str, new: str) -> str:
    """The command line to keep: a Ray worker's actor name beats IDLE, any beats none."""
    if not new:
        return old
    if old and new.startswith("ray::IDLE") and not old.startswith("ray::IDLE"):
        return old
    return new


def _busy_core_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``, all cores)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _resolved(command: list[str]) -> list[str]:
    """``gpusched``/``pytest``/``python`` as this interpreter's, so the run uses this install."""
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    if command[0] in ("gpusched", "pytest"):
        return [sys.executable, "-m", command[0], *command[1:]]
    return command


def sample(
    command: list[str], interval: float, only_mine: bool = False
) -> tuple[dict[tuple[int, float], Seen], float, float, int]:
    """Run ``command``; every process's CPU by (pid, start time), the wall, the machine's busy
    core-seconds over the run, and the command's exit status.

    ``only_mine``: only the processes that inherited the mark this run puts in
    the command's environment (what else runs on the machine is left out).
    """
    before: dict[tuple[int, float], float] = {}
    for proc in psutil.process_iter(["pid", "create_time", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            before[(proc.pid, proc.info["create_time"])] = times.user + times.system
    seen: dict[tuple[int, float], Seen] = {}
    busy0, began = _busy_core_seconds(), time.monotonic()
    mark = uuid.uuid4().hex
    child = subprocess.Popen(command, cwd=ROOT, env={**os.environ, MARK_VARIABLE: mark})
    me = psutil.Process().pid
    mine: dict[tuple[int, float], bool] = {}
    while child.poll() is None:
        for proc in psutil.process_iter(["pid", "ppid", "create_time", "cpu_times", "cmdline"]):
            times = proc.info["cpu_times"]
            if times is None or proc.pid == me:
                continue
            key = (proc.pid, proc.info["create_time"])
            if only_mine and not mine.setdefault(key, _marked(proc, mark)):
                continue
            cpu = times.user + times.system - before.get(key, 0.0)
            old = seen.get(key)
            cmdline = " ".join(proc.info["cmdline"] or [])
            seen[key] = Seen(cpu, _telling(old.cmdline if old else "", cmdline), proc.info["ppid"])
        time.sleep(interval)
    return seen, time.monotonic() - began, _busy_core_seconds() - busy0, child.returncode


def _marked(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get(MARK_VARIABLE) == mark
    except psutil.Error:
        return False


def table(seen: dict[tuple[int, float], Seen]) -> list[tuple[str, float, int]]:
    """(kind, core-seconds, processes), the largest first; processes that used under 0.05 s left out."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for process in seen.values():
        if process.cpu >= 0.05:
            row = rows[kind_of(process.cmdline)]
            row[0] += process.cpu
            row[1] += 1
    return sorted(((k, c, int(n)) for k, (c, n) in rows.items()), key=lambda r: -r[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    parser.add_argument(
        "--only-mine",
        action="store_true",
        help="count only the command's own processes (by a mark in their environment)",
    )
    parser.add_argument(
        "--dump", type=Path, help="also write every process (pid, parent, CPU, command) as JSON"
    )
    parser.add_argument("command", nargs="*", help="the command to run (after --)")
    args = parser.parse_args()
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    command = _resolved(args.command or DEFAULT)
    seen, wall, busy, code = sample(command, args.interval, args.only_mine)
    rows = table(seen)
    if args.dump:
        args.dump.write_text(json.dumps([
            {"pid": pid, "started": started, "ppid": p.ppid, "cpu": p.cpu, "cmdline": p.cmdline}
            for (pid, started), p in seen.items()
        ]))  # fmt: skip
    total = sum(c for _, c, _ in rows)
    print(f"\ncommand: {' '.join(command)}")
    print(f"exit {code}; wall {wall:.0f} s on {psutil.cpu_count()} cores; the machine was busy "
          f"{busy:.0f} core-s, {total:.0f} of them " + ("the command's own processes'" if
          args.only_mine else f"attributed below ({total / max(busy, 1e-9):.0%})"))  # fmt: skip
    print(f"\n{'kind':44} {'core-s':>8} {'share':>6} {'procs':>6} {'s/proc':>7}")
    for kind, cpu, count in rows:
        print(f"{kind:44} {cpu:8.1f} {cpu / total:6.1%} {count:6d} {cpu / count:7.1f}")
    return code


if __name__ == "__main__":
    sys.exit(main())
