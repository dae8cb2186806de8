"""``plan`` and ``run`` use the duration history: expected times, packing order, predicted makespan."""

from __future__ import annotations

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
    found = re.findall(r"^(test_\w+\.py)\s.*\s([\d.]+)s$", output, re.MULTILINE)
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
    write_history(suite, dump_history({k: Entry(v, v, 2) for k, v in KNOWN.items()}))
    done = gpusched(suite, "run")
    assert done.returncode == 0, done.stdout + done.stderr
    started = re.findall(r"^START\s+(\S+)", done.stdout, re.MULTILINE)
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
