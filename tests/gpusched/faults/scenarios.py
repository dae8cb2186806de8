"""The fault injections: each writes a small suite that breaks in one real way, runs gpusched on it
for real, and returns what happened next to what should have happened.

``observed`` is computed from the run's JSON report, exit code and output,
never copied from ``expected``; the tests compare the two and check the
details, ``bench/faults.py`` prints them as a table.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import inprocess
from deadlines import hang_guard
from faultkit import Observation, RunOutput, Sandbox, alive, observe, read_pids


def _outcome(run: RunOutput, name: str) -> str:
    return run.file(name)["outcome"]


# ---------------------------------------------------------------- 1 + 2: kills

ESCAPE_SUITE = {
    "test_escape.py": """
        import subprocess, sys, time
        from pathlib import Path
        import pytest

        PIDS = Path(__file__).with_name("escaped.pids")
        # A daemon that leaves the job's process group and its process tree:
        # new session, fork, the middle process exits (the grandchild is reparented
        # to init), the grandchild takes its own process group. Only the tag finds it.
        DAEMON = (
            "import os, sys, time\\n"
            "os.setsid()\\n"
            "if os.fork():\\n"
            "    os._exit(0)\\n"
            "os.setpgrp()\\n"
            "open(sys.argv[1], 'a').write(f'{os.getpid()} ')\\n"
            "time.sleep(300)\\n"
        )

        @pytest.mark.gpu1
        def test_escape():
            # A child in its own session that stays a descendant of the job.
            child = subprocess.Popen(
                [sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"]
            )
            subprocess.run([sys.executable, "-c", DAEMON, str(PIDS)], check=True, timeout=30)
            with open(PIDS, "a") as out:
                out.write(f"{child.pid} ")
            time.sleep(300)
        """,
    "test_next.py": """
        import psutil
        from pathlib import Path
        import pytest

        @pytest.mark.gpu1
        def test_card_handed_over_clean():
            # Runs on the same (only) card after test_escape.py: the escaped processes
            # must be gone before the card is handed out again.
            pids = [int(p) for p in Path(__file__).with_name("escaped.pids").read_text().split()]
            assert len(pids) == 2
            living = [p for p in pids if psutil.pid_exists(p)
                      and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            assert living == []
        """,
    "test_ignores_term.py": """
        import signal, time

        def test_ignores_sigterm():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(300)
        """,
    "test_setpgrp.py": """
        import os, subprocess, sys

        def test_own_process_group_still_works():
            os.setpgrp()
            assert os.getpgrp() == os.getpid()
            out = subprocess.run(
                [sys.executable, "-c", "import os; print(os.getpgrp())"],
                process_group=0, capture_output=True, text=True, check=True,
            )
            assert int(out.stdout) != os.getpgrp()
        """,
}
KILL_TIMEOUT = 6.0
KILL_GRACE = 1.0


def kills() -> list[Observation]:
    """Items 1 and 2: escaped processes and a SIGTERM-ignoring job, in one run."""
    with Sandbox(ESCAPE_SUITE) as box:
        run = box.run(
            "--simulate-gpus",
            "1",
            "--cpu-slots",
            "2",
            "--timeout",
            f"{KILL_TIMEOUT:g}",
            "--kill-grace",
            f"{KILL_GRACE:g}",
        )
        escaped = read_pids(box.suite / "escaped.pids")
        living = alive(escaped)
        escape = run.file("test_escape.py")
        next_file = run.file("test_next.py")
        ignores = run.file("test_ignores_term.py")
        left, temp = box.leftover_processes(), box.leftover_temp()
        return [
            Observation(
                "test spawns setsid/setpgrp daemons and hangs",
                "TIMEOUT; 2 escapees killed before the card is reused",
                f"{escape['outcome']}; {len(escaped) - len(living)} escapees killed"
                + (
                    " before the card is reused"
                    if next_file["outcome"] == "PASSED"
                    else f" (next file on the card: {next_file['outcome']})"
                ),
                left,
                temp,
                run,
                {"escaped": escaped, "living": living},
            ),
            Observation(
                "test ignores SIGTERM",
                f"TIMEOUT, SIGKILL after the {KILL_GRACE:g}s grace",
                f"{ignores['outcome']}, "
                + ("SIGKILL" if ignores["returncode"] == -signal.SIGKILL else "not SIGKILL")
                + (
                    f" after the {KILL_GRACE:g}s grace"
                    if ignores["duration"] >= KILL_TIMEOUT + KILL_GRACE - 0.05
                    else f" after only {ignores['duration']:.1f}s"
                ),
                left,
                temp,
                run,
            ),
            Observation(
                "test calls os.setpgrp() itself",
                "PASSED",
                run.file("test_setpgrp.py")["outcome"],
                left,
                temp,
                run,
            ),
        ]


# ---------------------------------------------------------------- 3: crashes

CRASH_SUITE = {
    "test_segv.py": """
        import ctypes

        def test_before():
            pass

        def test_segfault():
            ctypes.string_at(0)

        def test_after():
            pass
        """,
    "test_abort.py": """
        import os

        def test_ok():
            pass

        def test_abort():
            os.abort()
        """,
    "test_exit.py": """
        import os

        def test_exit_mid_test():
            os._exit(3)

        def test_never_reached():
            pass
        """,
    "test_fine.py": """
        def test_fine():
            pass
        """,
}


def _crash_line(run: RunOutput, name: str) -> str:
    entry = run.file(name)
    tests = run.tests(name)
    passed = sorted(test for test, outcome in tests.items() if outcome == "passed")
    return f"{entry['outcome']}: {entry['message']}; passed kept: {','.join(passed) or '-'}"


def crashes() -> list[Observation]:
    """Item 3: a segfault, an abort and an ``os._exit`` mid-test, next to a passing file."""
    with Sandbox(CRASH_SUITE) as box:
        run = box.run("--cpu-slots", "2")
        left, temp = box.leftover_processes(), box.leftover_temp()
        rows = [
            (
                "segfault mid-test",
                "test_segv.py",
                "CRASHED: killed by SIGSEGV during test_segv.py::test_segfault; "
                "passed kept: test_before",
            ),
            (
                "os.abort() mid-test",
                "test_abort.py",
                "CRASHED: killed by SIGABRT during test_abort.py::test_abort; passed kept: test_ok",
            ),
            (
                "os._exit(3) mid-test",
                "test_exit.py",
                "CRASHED: exited with code 3 during test_exit.py::test_exit_mid_test; "
                "passed kept: -",
            ),
        ]
        observations = [
            Observation(fault, expected, _crash_line(run, name), left, temp, run)
            for fault, name, expected in rows
        ]
        observations.append(
            Observation(
                "a file next to the crashes",
                "PASSED, run exit code 1",
                f"{_outcome(run, 'test_fine.py')}, run exit code {run.code}",
                left,
                temp,
                run,
            )
        )
        return observations


# ---------------------------------------------------------------- 4: signals

HANG_SUITE = {
    "test_a_hang.py": """
        import signal, subprocess, sys, time
        from pathlib import Path

        def test_hang():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends this one
            child = subprocess.Popen(
                [sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"]
            )
            Path(__file__).with_name("running.pids").write_text(f"{child.pid}")
            time.sleep(300)
        """,
    "test_b.py": "def test_b():\n    pass\n",
    "test_c.py": "def test_c():\n    pass\n",
}
SLEEP_SUITE = {
    "test_a_sleep.py": """
        import time
        from pathlib import Path

        def test_sleep():
            Path(__file__).with_name("running.pids").write_text("started")
            time.sleep(300)
        """,
    "test_b.py": "def test_b():\n    pass\n",
}
SECOND_SIGINT_GRACE = 30.0


def _interrupt_line(run: RunOutput, running: str, pending: list[str]) -> str:
    valid = run.report is not None and run.junit is not None
    outcomes = [run.file(running)["outcome"], *(run.file(name)["outcome"] for name in pending)]
    return (
        f"exit {run.code}; {outcomes[0]}; "
        + ",".join(sorted(set(outcomes[1:])))
        + f" x{len(pending)}; reports {'valid' if valid else 'MISSING'}"
        + ("; summary printed" if run.last_line.startswith("gpusched: ") else "; no summary")
    )


def sigint_twice() -> Observation:
    """Item 4: Ctrl-C while a SIGTERM-ignoring file runs, then Ctrl-C again: no grace left."""
    with Sandbox(HANG_SUITE) as box:
        proc = box.start("--cpu-slots", "1", "--kill-grace", f"{SECOND_SIGINT_GRACE:g}")
        try:
            box.wait_for_file("running.pids")
            proc.send_signal(signal.SIGINT)
            box.wait_for("gpusched: interrupted:")
            time.sleep(0.5)
            second = time.monotonic()
            proc.send_signal(signal.SIGINT)
            run = box.finish(proc, timeout=SECOND_SIGINT_GRACE * 2)
            after_second = time.monotonic() - second
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        quick = after_second < SECOND_SIGINT_GRACE / 3
        return observe(
            box,
            "Ctrl-C, then Ctrl-C again (file ignores SIGTERM)",
            "exit 2; INTERRUPTED; NOT RUN x2; reports valid; summary printed; "
            "killed at once by the second",
            _interrupt_line(run, "test_a_hang.py", ["test_b.py", "test_c.py"])
            + ("; killed at once by the second" if quick else f"; second took {after_second:.1f}s"),
            run,
            after_second=after_second,
            child=read_pids(box.suite / "running.pids"),
        )


def sigterm() -> Observation:
    """Item 4: SIGTERM to the scheduler while a file runs and another waits."""
    with Sandbox(SLEEP_SUITE) as box:
        proc = box.start("--cpu-slots", "1", "--kill-grace", "5")
        try:
            box.wait_for_file("running.pids")
            proc.send_signal(signal.SIGTERM)
            run = box.finish(proc, timeout=hang_guard(60))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return observe(
            box,
            "SIGTERM to gpusched while a file runs",
            "exit 2; INTERRUPTED; NOT RUN x1; reports valid; summary printed",
            _interrupt_line(run, "test_a_sleep.py", ["test_b.py"]),
            run,
        )


HANG_CONFTEST = {
    "conftest.py": """
        import time
        from pathlib import Path

        Path(__file__).with_name("collecting").write_text("yes")
        time.sleep(300)
        """,
    "test_x.py": "def test_x():\n    pass\n",
}


def sigint_during_collection() -> Observation:
    """Item 4, the ``KeyboardInterrupt`` path: Ctrl-C while the collection child hangs."""
    with Sandbox(HANG_CONFTEST) as box:
        proc = box.start()
        try:
            box.wait_for_file("collecting")
            proc.send_signal(signal.SIGINT)
            run = box.finish(proc, timeout=hang_guard(60))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        said = "interrupted during collection" in run.out
        return observe(
            box,
            "Ctrl-C during collection (KeyboardInterrupt)",
            "exit 2; interrupted during collection; JSON valid",
            f"exit {run.code}; "
            + ("interrupted during collection" if said else "no message")
            + ("; JSON valid" if run.report is not None else "; JSON missing"),
            run,
        )


# ---------------------------------------------------------------- 5: collection timeout


def collection_timeout() -> Observation:
    """Item 5: a conftest that hangs at import, with ``--collect-timeout 2``."""
    with Sandbox(HANG_CONFTEST) as box:
        run = box.run("--collect-timeout", "2", timeout=hang_guard(60))
        said = "collection timed out after 2s (--collect-timeout)" in run.out
        return observe(
            box,
            "conftest hangs at import",
            "exit 3; collection timed out after 2s (--collect-timeout)",
            f"exit {run.code}; "
            + ("collection timed out after 2s (--collect-timeout)" if said else "no message"),
            run,
        )


# ---------------------------------------------------------------- 6: heartbeat

HEARTBEAT_SUITE = {
    "test_long.py": "import time\n\ndef test_long():\n    time.sleep(3)\n",
    "test_short.py": "import time\n\ndef test_short():\n    time.sleep(1)\n",
}
HEARTBEAT = 0.5


def heartbeat_problems(lines: list[str], interval: float) -> list[str]:
    """What is wrong with a run's heartbeat lines: duplicates, or elapsed times not advancing."""
    problems = []
    if len(set(lines)) != len(lines):
        problems.append("duplicated lines")
    last: dict[str, float] = {}
    for line in lines:
        for part in line.split(": ", 2)[2].split(", "):
            name, _, elapsed = part.rpartition(" ")
            seconds = float(elapsed.rstrip("s"))
            if name in last and not seconds > last[name] + interval / 2:
                problems.append(f"{name}: {last[name]}s then {seconds}s")
            last[name] = seconds
    return problems


def heartbeat() -> Observation:
    """Item 6: ``--heartbeat 0.5`` on a 3 s file and a 1 s file running side by side."""
    with Sandbox(HEARTBEAT_SUITE) as box:
        run = box.run("--cpu-slots", "2", "--heartbeat", f"{HEARTBEAT:g}")
        lines = run.lines("gpusched: running ")
        problems = heartbeat_problems(lines, HEARTBEAT)
        both = [line for line in lines if "test_long.py" in line and "test_short.py" in line]
        return observe(
            box,
            "--heartbeat 0.5 with two files running",
            "one line per interval, both files listed while both run, no duplicates",
            (
                "one line per interval"
                if len(lines) >= 3 and not problems
                else f"{len(lines)} lines: {problems}"
            )
            + (", both files listed while both run" if both else ", never both listed")
            + (", no duplicates" if len(set(lines)) == len(lines) else ", duplicates"),
            run,
            lines=lines,
        )


# ---------------------------------------------------------------- 7: environment hygiene

RAY_FILE = """
    import json, os, time
    from pathlib import Path
    import ray

    HERE = Path(__file__).parent
    OTHER = {"test_ray_a": "test_ray_b", "test_ray_b": "test_ray_a"}

    @ray.remote
    def niceness():
        return os.nice(0)

    def test_own_cluster():
        me = Path(__file__).stem
        info = {
            "ray_address_set": "RAY_ADDRESS" in os.environ,
            "ray_tmpdir": os.environ["RAY_TMPDIR"],
            "master_port": os.environ["MASTER_PORT"],
            "test_nice": os.nice(0),
        }
        context = ray.init(num_cpus=1, include_dashboard=False)
        try:
            info["gcs"] = context.address_info["gcs_address"]
            info["session_dir"] = context.address_info["session_dir"]
            info["worker_nice"] = ray.get(niceness.remote())
            (HERE / f"{me}.part").write_text(json.dumps(info))
            os.replace(HERE / f"{me}.part", HERE / f"{me}.json")
            # Stay up until the other file's cluster is up too, so the two overlap.
            deadline = time.monotonic() + 90
            while not (HERE / f"{OTHER[me]}.json").exists():
                assert time.monotonic() < deadline, "the other file never started its cluster"
                time.sleep(0.1)
            assert len(ray.nodes()) == 1  # attached to nobody, nobody attached to us
        finally:
            ray.shutdown()
    """
RAY_SUITE = {"test_ray_a.py": RAY_FILE, "test_ray_b.py": RAY_FILE}


def two_ray_clusters() -> Observation:
    """Item 7: ``RAY_ADDRESS`` set in the parent; two files each ``ray.init()`` at once."""
    import json

    # A parent RAY_ADDRESS that would make ray.init() fail to connect if it leaked.
    with Sandbox(RAY_SUITE, {"RAY_ADDRESS": "127.0.0.1:9"}) as box:
        run = box.run("--cpu-slots", "2", "--timeout", "150", timeout=200)
        infos = []
        for name in ("test_ray_a.json", "test_ray_b.json"):
            path = box.suite / name
            infos.append(json.loads(path.read_text()) if path.exists() else {})
        outcomes = [_outcome(run, "test_ray_a.py"), _outcome(run, "test_ray_b.py")]
        leaked = any(info.get("ray_address_set", True) for info in infos)
        tmpdirs = {info.get("ray_tmpdir") for info in infos}
        inside = all(
            info.get("session_dir", "").startswith(info.get("ray_tmpdir", "?") + "/")
            for info in infos
        )
        separate = len({info.get("gcs") for info in infos}) == 2 and len(tmpdirs) == 2
        return observe(
            box,
            "RAY_ADDRESS set; two files ray.init() at once",
            "PASSED x2; RAY_ADDRESS absent; 2 separate clusters, each under its own RAY_TMPDIR",
            f"{','.join(sorted(set(outcomes)))} x2; "
            + ("RAY_ADDRESS leaked" if leaked else "RAY_ADDRESS absent")
            + ("; 2 separate clusters" if separate else "; clusters shared")
            + (", each under its own RAY_TMPDIR" if inside else ", outside RAY_TMPDIR"),
            run,
            infos=infos,
        )


# ---------------------------------------------------------------- 9: flaky reruns

FLAKY_SUITE = {
    "test_flaky.py": """
        import os
        from pathlib import Path

        ATTEMPTS = Path(__file__).with_name("flaky.pids")

        def test_fails_once():
            with open(ATTEMPTS, "a") as out:
                out.write(f"{os.getpid()} ")
            assert len(ATTEMPTS.read_text().split()) > 1, "first attempt fails"
        """,
    "test_broken.py": "def test_broken():\n    assert False\n",
}


def flaky() -> Observation:
    """Item 9: ``--reruns 2``: a file that fails once, and one that always fails."""
    with Sandbox(FLAKY_SUITE) as box:
        run = box.run("--cpu-slots", "2", "--reruns", "2")
        flaky_entry, broken = run.file("test_flaky.py"), run.file("test_broken.py")
        pids = read_pids(box.suite / "flaky.pids")
        named = any(
            line.startswith("gpusched: flaky: test_flaky.py") for line in run.out.splitlines()
        )
        return observe(
            box,
            "--reruns 2: fails once / always fails",
            "FLAKY after 2 fresh processes, named in summary and JUnit; FAILED after 3",
            f"{flaky_entry['outcome']} after {len(set(pids))} fresh processes"
            + (
                ", named in summary and JUnit"
                if named and run.junit_property("test_flaky.py", "outcome") == "FLAKY"
                else ", not named"
            )
            + f"; {broken['outcome']} after {broken['attempts']}",
            run,
            pids=pids,
        )


def _listed(function: Callable[[], Observation | list[Observation]]):
    def call() -> list[Observation]:
        result = function()
        return result if isinstance(result, list) else [result]

    return call


# In the order of the issue; each entry runs one or more injections.
ALL: list[tuple[str, Callable[[], list[Observation]]]] = [
    ("kills", _listed(kills)),
    ("crashes", _listed(crashes)),
    ("sigint_twice", _listed(sigint_twice)),
    ("sigterm", _listed(sigterm)),
    ("sigint_during_collection", _listed(sigint_during_collection)),
    ("cancelled", _listed(inprocess.cancelled)),
    ("keyboard_interrupt", _listed(inprocess.keyboard_interrupt)),
    ("collection_timeout", _listed(collection_timeout)),
    ("heartbeat", _listed(heartbeat)),
    ("two_ray_clusters", _listed(two_ray_clusters)),
    ("gpu_release", _listed(inprocess.gpu_release)),
    ("flaky", _listed(flaky)),
]
