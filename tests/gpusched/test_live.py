"""Live progress: a rich view on a terminal, plain lines without control codes in CI or a pipe."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest
from deadlines import hang_guard
from rich.console import Console

from gpusched.reporting.live import LiveReporter, LiveState, wants_live
from gpusched.requirements import Requirement
from gpusched.results import FileResult, Outcome
from gpusched.scheduling import Job

ESC = "\x1b"


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(
    ("tty", "env", "live"),
    [
        (True, {}, True),
        (True, {"CI": "true"}, False),
        (True, {"CI": "1"}, False),
        (True, {"CI": "false"}, True),
        (True, {"TERM": "dumb"}, False),
        (False, {}, False),
    ],
)
def test_live_only_on_a_terminal_outside_ci(tty, env, live):
    assert wants_live(_Stream(tty), env) is live


def _job(n: int, path: str, gpus: int, expected: float) -> Job:
    return Job(n, path, Requirement(gpus), expected)


def test_state_rows_show_each_card_and_cpu_slot_with_elapsed_and_expected():
    state = LiveState(("0", "1", "2"), cpu_slots=2, total=4)
    state.start(_job(0, "/s/test_big.py", 2, 9.0), ("0", "1"), 1, now=10.0)
    state.start(_job(1, "/s/test_cpu.py", 0, 3.0), (), 1, now=11.0)
    rows = {row.slot: row for row in state.rows(now=14.0)}
    assert list(rows) == ["gpu 0", "gpu 1", "gpu 2", "cpu 1", "cpu 2"]
    assert rows["gpu 0"].path == rows["gpu 1"].path == "/s/test_big.py"
    assert (rows["gpu 0"].elapsed, rows["gpu 0"].expected) == (4.0, 9.0)
    assert (rows["cpu 1"].path, rows["cpu 1"].elapsed) == ("/s/test_cpu.py", 3.0)
    assert rows["gpu 2"].path is None and rows["cpu 2"].path is None
    assert state.summary(4.0) == "0/4 files done | 2 running | 2 pending | 4s elapsed"
    state.finish(FileResult("/s/test_big.py", Outcome.PASSED, ("0", "1"), 0.0, 4.0))
    assert state.rows(now=15.0)[0].path is None
    assert state.summary(5.0) == "1/4 files done (1 passed) | 1 running | 2 pending | 5s elapsed"


def test_light_files_beyond_the_cpu_slots_each_get_a_row_of_their_own():
    """Files that use little CPU run more at once than there are slots (packing on cores)."""
    state = LiveState((), cpu_slots=2, total=4)
    for i in range(4):
        state.start(_job(i, f"/s/test_{i}.py", 0, 1.0), (), 1, now=0.0)
    rows = {row.slot: row.path for row in state.rows(now=1.0)}
    assert rows == {f"cpu {i + 1}": f"/s/test_{i}.py" for i in range(4)}
    state.finish(FileResult("/s/test_1.py", Outcome.PASSED, (), 0.0, 1.0))
    state.start(_job(4, "/s/test_4.py", 0, 1.0), (), 1, now=1.0)
    assert {row.slot: row.path for row in state.rows(now=2.0)}["cpu 2"] == "/s/test_4.py"


def test_a_node_that_joins_adds_its_idle_cards_and_slots_as_rows():
    state = LiveState(("a:0",), cpu_slots=1, total=2)
    state.add_slots(("b:0", "b:1"), 1)
    state.start(_job(0, "/s/test_one.py", 1, 2.0), ("b:1",), 1, now=1.0)
    rows = {row.slot: row.path for row in state.rows(now=2.0)}
    assert rows == {
        "gpu a:0": None,
        "gpu b:0": None,  # idle, but in the view from the moment its node joined
        "gpu b:1": "/s/test_one.py",
        "cpu 1": None,
        "cpu 2": None,
    }


def test_a_file_started_again_elsewhere_leaves_its_old_cards():
    state = LiveState(("a:0", "b:0", "b:1"), cpu_slots=0, total=1)
    state.start(_job(0, "/s/test_b.py", 1, 2.0), ("a:0",), 1, now=1.0)
    state.start(_job(0, "/s/test_b.py", 2, 2.0), ("b:0", "b:1"), 1, now=2.0)
    rows = {row.slot: row.path for row in state.rows(now=3.0)}
    assert rows == {"gpu a:0": None, "gpu b:0": "/s/test_b.py", "gpu b:1": "/s/test_b.py"}


def test_the_total_grows_while_collection_streams_files_in():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    clock = iter(float(n) for n in range(100)).__next__
    with LiveReporter(["0"], 1, 0, console=console, clock=clock, collecting=True) as live:
        live.grow(2)
        assert live.state.summary(1.0) == (
            "0/2+ files done | 0 running | 2 pending | collecting | 1s elapsed"
        )
        live.started(_job(0, "/s/test_a.py", 0, 1.0), (), 1)
        live.grow(1)
        live.collection_done()
        assert live.state.summary(2.0) == "0/3 files done | 1 running | 2 pending | 2s elapsed"


def test_reporter_draws_a_table_with_control_codes_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system="standard")
    clock = iter([0.0, 1.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).__next__
    with LiveReporter(["0", "1"], 1, 2, console=console, clock=clock, refresh_per_second=1) as live:
        live.started(_job(0, "/s/test_pair.py", 2, 4.0), ("0", "1"), 1)
        live.finished(FileResult("/s/test_pair.py", Outcome.FAILED, ("0", "1"), 0.0, 2.0))
    text = out.getvalue()
    assert ESC + "[" in text  # cursor movement and colour: a live view
    assert "slot" in text and "gpu 0" in text and "test_pair.py" in text and "4.0s" in text
    assert "FAILED" in text and "1/2 files done (1 failed)" in text


SUITE = {
    "test_one.py": "import time, pytest\npytestmark = pytest.mark.gpu(1)\n"
    "def test_a():\n    time.sleep(0.8)\n",
    "test_cpu.py": "import time\ndef test_b():\n    time.sleep(0.8)\n",
}


def _run_in_pty(cwd, env: dict[str, str]) -> tuple[int, str]:
    """``gpusched run`` with a pseudo-terminal as stdout and stderr, as a person would see it."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusched", "run", ".", "--simulate-gpus", "2"],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
        )
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=hang_guard(120)), b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    for name, text in SUITE.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_ACTIONS", "NO_COLOR")}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40", **extra)
    return env


def test_a_terminal_gets_the_live_view(suite):
    code, text = _run_in_pty(suite, _env())
    assert code == 0, text
    assert ESC + "[" in text
    assert "slot" in text and "gpu 0" in text and "cpu 1" in text and "files done" in text
    assert text.rstrip().splitlines()[-1].endswith("gpusched: 2 passed, 0 failed, 0 skipped")


def test_ci_gets_plain_lines_even_on_a_terminal(suite):
    code, text = _run_in_pty(suite, _env(CI="true"))
    assert code == 0, text
    assert ESC not in text
    lines = text.replace("\r\n", "\n").strip().splitlines()
    assert any(line.startswith("START") and "test_one.py [gpu 0]" in line for line in lines)
    assert lines[-1] == "gpusched: 2 passed, 0 failed, 0 skipped"
