"""``plan`` and ``run`` use the duration history: expected times, CPU use, packing order,
predicted makespan."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from deadlines import hang_guard

from gpusched.history import Entry, dump_history, load_history

NEEDS = {"test_a.py": 2, "test_b.py": 1, "test_c.py": 1, "test_d.py": 1}
KNOWN = {"test_a.py": 5.0, "test_b.py": 3.0, "test_c.py": 4.0}  # test_d.py is new


@pytest.fixture
def suite(tmp_path):
    for name, gpus in NEEDS.items():
        (tmp_path / name).write_text(
            f"import pytest\npytestmark = pytest.mark.gpu({gpus})\ndef test_x():\n    pass\n",
            encoding="utf-8",
        )
    (tmp_path / ".gpusched").mkdir()
    return tmp_path


def write_history(root, text: str) -> None:
    (root / ".gpusched" / "durations.json").write_text(text, encoding="utf-8")


def gpusched(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpusched", *args, ".", "--simulate-gpus", "2", "--cpu-slots", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=hang_guard(120),
    )


def expected_column(output: str) -> dict[str, float]:
    found = re.findall(r"^(test_\w+\.py)\s.*\s([\d.]+)s\s+\S+\s+\S+$", output, re.MULTILINE)
    return {name: float(seconds) for name, seconds in found}


def predicted(output: str) -> float:
    return float(re.search(r"predicted makespan ([\d.]+)s for 4 files \(ETA ", output).group(1))


def test_plan_names_the_durations_seed_that_filled_in_the_history(suite):
    write_history(suite, dump_history({k: Entry(v, v, 2) for k, v in KNOWN.items()}))
    seed = suite / "ci-durations.json"
    seed.write_text(dump_history({"test_d.py": Entry(6.0, 6.0, 1)}), encoding="utf-8")
    done = gpusched(suite, "plan", "--durations-seed", str(seed))
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected_column(done.stdout) == {**KNOWN, "test_d.py": 6.0}
    assert (
        f"expected durations of 4 of 4 files from .gpusched/durations.json and {seed}"
        in done.stdout
    ), done.stdout


def test_plan_predicts_from_the_history_and_gives_unknown_files_the_mean(suite):
    write_history(suite, dump_history({k: Entry(v, v, 2) for k, v in KNOWN.items()}))
    done = gpusched(suite, "plan")
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected_column(done.stdout) == {**KNOWN, "test_d.py": 4.0}
    assert "expected durations of 3 of 4 files from .gpusched/durations.json" in done.stdout
    # a (2 cards) 0-5; then c and d (4 s each, longest first) 5-9; then b 9-12.
    starts = re.findall(
        r"^\s+([\d.]+)s ->\s+([\d.]+)s\s+\[gpu [\d,]+\]\s+(\S+)$", done.stdout, re.M
    )
    assert [(name, float(s), float(e)) for s, e, name in starts] == [
        ("test_a.py", 0.0, 5.0),
        ("test_c.py", 5.0, 9.0),
        ("test_d.py", 5.0, 9.0),
        ("test_b.py", 9.0, 12.0),
    ]
    assert predicted(done.stdout) == 12.0


def test_a_corrupt_history_is_reported_and_plan_goes_on_without_it(suite):
    write_history(suite, '{"version": 1, "files": {"test_a.py": {"seconds": ')
    done = gpusched(suite, "plan")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpusched: warning: duration history .gpusched/durations.json is corrupt" in done.stdout
    assert set(expected_column(done.stdout).values()) == {1.0}
    assert predicted(done.stdout) == 3.0  # a 0-1, b and c 1-2, d 2-3


def test_run_packs_longest_expected_first_and_records_every_file(suite):
    """Files start as the collection finds them, so test_a.py (both cards) holds them until
    the run says collection is done: the order of the rest is then the packing's alone."""
    write_history(suite, dump_history({k: Entry(v, v, 2) for k, v in KNOWN.items()}))
    collected = suite / "collected"
    (suite / "test_a.py").write_text(
        "import os, time\nimport pytest\npytestmark = pytest.mark.gpu(2)\n"
        "def test_x():\n"
        f"    deadline = time.monotonic() + {hang_guard(60)}\n"
        f"    while not os.path.exists({str(collected)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n",
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "gpusched", "run", ".", "--simulate-gpus", "2"]
    proc = subprocess.Popen(
        [*command, "--cpu-slots", "1"], cwd=suite, stdout=subprocess.PIPE, text=True
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"gpusched: 4 files on ", line):
                collected.touch()
        code = proc.wait(hang_guard(120))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert code == 0, output
    assert collected.exists(), output  # the run said collection was done
    started = re.findall(r"^START\s+(\S+)", output, re.MULTILINE)
    assert started == ["test_a.py", "test_c.py", "test_d.py", "test_b.py"]
    history, warning = load_history(suite / ".gpusched" / "durations.json")
    assert warning is None
    assert {key: entry.runs for key, entry in history.items()} == {
        "test_a.py": 3,
        "test_b.py": 3,
        "test_c.py": 3,
        "test_d.py": 1,
    }
    # The moving average moved halfway towards this run's (short) wall time.
    assert history["test_a.py"].seconds == pytest.approx(
        (5.0 + history["test_a.py"].last) / 2, abs=1e-3
    )
    again = gpusched(suite, "plan")
    assert "expected durations of 4 of 4 files" in again.stdout


def cpu_columns(output: str) -> dict[str, tuple[str, str]]:
    """``plan``'s cpu and peak columns by file (``-``: never measured)."""
    found = re.findall(r"^(test_\w+\.py)\s.*\s[\d.]+s\s+(\S+)\s+(\S+)$", output, re.MULTILINE)
    return {name: (cpu, peak) for name, cpu, peak in found}


def test_run_measures_each_files_cpu_and_plan_shows_it(tmp_path):
    """An old history without CPU figures is read; the run fills them in from psutil."""
    (tmp_path / "test_burn.py").write_text(
        "import time\n\ndef test_burn():\n    while time.process_time() < 1.5:\n        pass\n",
        encoding="utf-8",
    )
    (tmp_path / "test_rest.py").write_text(
        "import time\n\ndef test_rest():\n    time.sleep(1.5)\n", encoding="utf-8"
    )
    (tmp_path / ".gpusched").mkdir()
    old = {
        name: {"seconds": 2.0, "last": 2.0, "runs": 1} for name in ("test_burn.py", "test_rest.py")
    }
    write_history(tmp_path, json.dumps({"version": 1, "files": old}))
    before = gpusched(tmp_path, "plan")
    assert before.returncode == 0, before.stdout + before.stderr
    assert cpu_columns(before.stdout) == {"test_burn.py": ("-", "-"), "test_rest.py": ("-", "-")}
    assert "CPU use of 2 of 2 files never measured" in before.stdout
    done = gpusched(tmp_path, "run")
    assert done.returncode == 0, done.stdout + done.stderr
    history, warning = load_history(tmp_path / ".gpusched" / "durations.json")
    assert warning is None
    burn, rest = history["test_burn.py"], history["test_rest.py"]
    assert burn.runs == rest.runs == 2
    assert burn.cpu is not None and rest.cpu is not None
    assert burn.cpu > rest.cpu  # the same wall time: one burnt its CPU, one slept
    assert burn.peak is not None and burn.peak >= burn.cpu
    after = gpusched(tmp_path, "plan")
    shown = cpu_columns(after.stdout)
    assert shown["test_burn.py"] == (f"{burn.cpu:.2f}", f"{burn.peak:.2f}")
    assert shown["test_rest.py"][0] == f"{rest.cpu:.2f}"
    assert "never measured" not in after.stdout
