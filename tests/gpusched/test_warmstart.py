"""Warm starts: the gate protocol on real processes, and ``gpusched run --prestart`` end to end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

from gpusched.execution.warmstart import (
    CANCELLED,
    CUDA_TOO_EARLY,
    GATE_VARIABLE,
    Gate,
    go_message,
    prestart_env,
)

CHILD = """
import os, sys
{before}
from gpusched.execution.warmstart import wait_at_gate
wait_at_gate()
print(os.environ["CUDA_VISIBLE_DEVICES"], os.environ.get("GPUSCHED_GATE_FD"), flush=True)
"""


def _spawn(gate: Gate, code: str) -> subprocess.Popen:
    env = prestart_env(
        {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        {"CUDA_VISIBLE_DEVICES": "0"},
        gate.child_fd,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        pass_fds=(gate.child_fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gate.spawned()
    return proc


def _gated_child(before: str = "") -> tuple[subprocess.Popen, Gate]:
    """A child waiting at its gate (it said ``ready``)."""
    gate = Gate()
    proc = _spawn(gate, CHILD.format(before=before))
    asyncio.run(asyncio.wait_for(gate.ready(), 30))
    return proc, gate


def test_prestart_env_hides_every_card_until_the_gate_opens():
    env = prestart_env(
        {"CUDA_VISIBLE_DEVICES": "3", "PATH": "/bin"}, {"CUDA_VISIBLE_DEVICES": "3"}, 7
    )
    assert env == {"CUDA_VISIBLE_DEVICES": "", "PATH": "/bin", GATE_VARIABLE: "7"}
    assert json.loads(go_message({"CUDA_VISIBLE_DEVICES": "2,3"})) == {
        "CUDA_VISIBLE_DEVICES": "2,3"
    }


def test_child_waits_at_the_gate_then_runs_with_the_cards_it_is_sent():
    proc, gate = _gated_child()
    time.sleep(0.3)
    assert proc.poll() is None, "the child went past a closed gate"
    assert gate.open({"CUDA_VISIBLE_DEVICES": "2,3"})
    out, err = proc.communicate(timeout=hang_guard(30))
    gate.close()
    assert proc.returncode == 0, err
    assert out.split() == ["2,3", "None"]  # cards applied; the gate variable is not inherited


def test_a_gate_opened_before_the_child_arrives_lets_it_straight_through():
    gate = Gate()
    proc = _spawn(gate, CHILD.format(before=""))
    assert gate.open({"CUDA_VISIBLE_DEVICES": "1"})
    out, err = proc.communicate(timeout=hang_guard(30))
    asyncio.run(asyncio.wait_for(gate.ready(), 5))
    gate.close()
    assert proc.returncode == 0, err
    assert out.split() == ["1", "None"]


def test_closing_the_gate_without_a_message_ends_the_child():
    proc, gate = _gated_child()
    gate.cancel()
    _, err = proc.communicate(timeout=hang_guard(30))
    gate.close()
    assert proc.returncode == CANCELLED
    assert "not needed" in err


def test_a_child_that_exits_before_its_gate_counts_as_ready_and_cannot_be_opened():
    gate = Gate()
    proc = _spawn(gate, "raise SystemExit(4)")
    asyncio.run(asyncio.wait_for(gate.ready(), 30))  # end of file, no ready line
    assert proc.wait(timeout=hang_guard(30)) == 4
    assert gate.open({"CUDA_VISIBLE_DEVICES": "0"}) is False
    gate.close()


def test_cuda_initialised_before_the_gate_refuses_to_run():
    # No driver here: a stand-in torch whose CUDA reports itself initialised.
    fake_torch = (
        "import types\n"
        "sys.modules['torch'] = types.SimpleNamespace("
        "cuda=types.SimpleNamespace(is_initialized=lambda: True))"
    )
    proc, gate = _gated_child(before=fake_torch)
    gate.open({"CUDA_VISIBLE_DEVICES": "1"})
    out, err = proc.communicate(timeout=hang_guard(30))
    gate.close()
    assert proc.returncode == CUDA_TOO_EARLY
    assert "--prestart 0" in err and out == ""


RECORDING = """
    import json, os, time
    import pytest

    pytestmark = pytest.mark.gpu({gpus})

    def test_record():
        time.sleep({sleep})
        with open({log!r}, "a") as out:
            out.write(json.dumps({{"file": os.path.basename(__file__), "pid": os.getpid(),
                                   "cards": os.environ["CUDA_VISIBLE_DEVICES"]}}) + "\\n")
"""

CONFTEST = """
    import json, os, time
    import psutil

    with open({log!r}, "a") as out:
        out.write(json.dumps({{"pid": os.getpid(), "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
                               "waited": time.time() - psutil.Process().create_time()}}) + "\\n")
"""


def test_warm_started_files_get_their_cards_before_conftest_loads(
    make_suite, run_gpusched, tmp_path
):
    tests_log, conftest_log = str(tmp_path / "tests.jsonl"), str(tmp_path / "conftest.jsonl")
    files = {"conftest.py": CONFTEST.format(log=conftest_log)}
    files["test_a_long.py"] = RECORDING.format(gpus=2, sleep=3.0, log=tests_log)
    for i in range(4):
        files[f"test_b{i}.py"] = RECORDING.format(gpus=1, sleep=0.2, log=tests_log)
    make_suite(files)
    result = run_gpusched(
        "run", ".", "--simulate-gpus", "2", "--prestart", "2", "--fork-server", "off"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "gpusched: 5 passed, 0 failed, 0 skipped"
    tests = {r["pid"]: r for r in map(json.loads, open(tests_log))}
    conftests = {r["pid"]: r for r in map(json.loads, open(conftest_log)) if r["pid"] in tests}
    assert set(conftests) == set(tests)
    for pid, record in tests.items():
        assert record["cards"], f"{record['file']} saw no card"
        assert conftests[pid]["cards"] == record["cards"], record["file"]
    # The 1-card files were started while test_a_long held both cards and waited at the gate.
    assert max(r["waited"] for r in conftests.values()) > 1.5


def _suite_processes(root: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if (
            any(str(root) in part for part in proc.info["cmdline"] or ())
            and proc.pid != os.getpid()
        ):
            found.append(proc)
    return found


def test_x_stop_ends_the_waiting_children_and_removes_their_logs(
    make_suite, run_gpusched, tmp_path
):
    failing = """
        import time
        import pytest

        @pytest.mark.gpu(1)
        def test_fail():
            time.sleep(1.0)
            assert False
    """
    files = {"test_a_fail.py": failing}
    for i in range(4):
        files[f"test_b{i}.py"] = RECORDING.format(gpus=1, sleep=0.1, log=str(tmp_path / "x"))
    make_suite(files)
    result = run_gpusched(
        "run",
        str(tmp_path),
        "--simulate-gpus",
        "1",
        "--prestart",
        "3",
        "-x",
        "--fork-server",
        "off",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT RUN" in result.stdout
    assert not _suite_processes(tmp_path)
    logs = sorted(p.name for p in (tmp_path / ".gpusched" / "logs").iterdir())
    assert logs == ["test_a_fail.py.log"]


def test_ctrl_c_ends_the_waiting_children_too(make_suite, tmp_path):
    hang = """
        import time
        import pytest

        @pytest.mark.gpu(1)
        def test_hang():
            time.sleep(60)
    """
    make_suite({"test_a_hang.py": hang, **{f"test_b{i}.py": hang for i in range(3)}})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "CUDA_VISIBLE"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpusched", "run", str(tmp_path), "--simulate-gpus", "1",
         "--prestart", "3", "--kill-grace", "1", "--fork-server", "off"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            waiting = [p for p in _suite_processes(tmp_path) if _is_waiting(p)]
            if len(waiting) == 3:
                break
            time.sleep(0.2)
        assert len(waiting) == 3, "three files should wait at the gate"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=hang_guard(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, out
    assert not _suite_processes(tmp_path)


def _is_waiting(proc: psutil.Process) -> bool:
    """A warm-started child: started with a gate and no card (its initial environment)."""
    try:
        env = proc.environ()
        return GATE_VARIABLE in env and env.get("CUDA_VISIBLE_DEVICES") == ""
    except psutil.Error:
        return False


@pytest.mark.parametrize("args", [["--prestart", "-1"], ["--prestart", "two"]])
def test_bad_prestart_is_a_usage_error(args, make_suite, run_gpusched):
    make_suite({"test_x.py": "def test_x():\n    pass\n"})
    result = run_gpusched("run", ".", *args)
    assert result.returncode == 4
    assert "prestart" in result.stderr + result.stdout
