"""Acceptance: the real ``gpusched run`` command on small suites in a temp dir."""

import json
import os
import time
import xml.etree.ElementTree as ET

import psutil
import pytest

RECORDING_TEST = """
    import json, os, time
    import pytest

    {marker}
    def test_record():
        start = time.time()
        time.sleep({sleep})
        with open({log!r}, "a") as out:
            out.write(json.dumps({{
                "file": __file__, "cards": os.environ["CUDA_VISIBLE_DEVICES"],
                "start": start, "end": time.time(), "port": os.environ["MASTER_PORT"],
                "ray_tmpdir": os.environ["RAY_TMPDIR"], "ray_address": "RAY_ADDRESS" in os.environ,
            }}) + "\\n")
"""


def test_no_two_running_files_share_a_card(make_suite, run_gpusched, tmp_path):
    log = str(tmp_path / "record.jsonl")
    gpus = [2, 1, 1, 2, 3, 1, 0, 0, 1, 2]
    files = {
        f"test_f{i}.py": RECORDING_TEST.format(
            marker=f"@pytest.mark.gpu({n})" if n else "", sleep=0.3, log=log
        )
        for i, n in enumerate(gpus)
    }
    make_suite(files)
    result = run_gpusched("run", ".", "--simulate-gpus", "4", RAY_ADDRESS="127.0.0.1:6379")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "gpusched: 10 passed, 0 failed, 0 skipped"
    records = [json.loads(line) for line in open(log)]
    assert len(records) == len(gpus)
    by_file = {os.path.basename(r["file"]): r for r in records}
    for i, n in enumerate(gpus):
        cards = [c for c in by_file[f"test_f{i}.py"]["cards"].split(",") if c]
        assert len(cards) == n and len(set(cards)) == n
        assert all(c in {"0", "1", "2", "3"} for c in cards)
    intervals = [
        (card, r["start"], r["end"], r["file"])
        for r in records
        for card in r["cards"].split(",")
        if card
    ]
    for card, start, end, name in intervals:
        for other_card, other_start, other_end, other in intervals:
            if other != name and other_card == card:
                assert end <= other_start or other_end <= start, (
                    f"{name} and {other} share card {card}"
                )
    assert len({r["port"] for r in records}) == len(records)
    assert len({r["ray_tmpdir"] for r in records}) == len(records)
    assert not any(r["ray_address"] for r in records)


def test_failing_file_exits_1_and_shows_its_tail(make_suite, run_gpusched):
    make_suite(
        {
            "test_ok.py": "def test_ok():\n    pass\n",
            "test_bad.py": "def test_bad():\n    assert 'expected' == 'MARKER-IN-TAIL'\n",
        }
    )
    result = run_gpusched("run", ".")
    assert result.returncode == 1
    assert "FAILED      test_bad.py [cpu]" in result.stdout
    assert "MARKER-IN-TAIL" in result.stdout
    assert result.stdout.splitlines()[-1] == "gpusched: 1 passed, 1 failed, 0 skipped"


def test_syntax_error_in_one_file_does_not_stop_the_others(make_suite, run_gpusched, tmp_path):
    make_suite(
        {
            "test_broken.py": "def test_x(:\n    pass\n",
            "test_fine.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
        }
    )
    report = tmp_path / "report.json"
    result = run_gpusched("run", ".", "--json", str(report))
    assert result.returncode == 1
    assert "ERROR       test_broken.py" in result.stdout and "SyntaxError" in json.dumps(
        json.loads(report.read_text())
    )
    assert "PASSED      test_fine.py" in result.stdout
    assert result.stdout.splitlines()[-1] == "gpusched: 2 passed, 1 failed, 0 skipped"


def test_timeout_kills_children_and_grandchildren(make_suite, run_gpusched, tmp_path):
    pids = tmp_path / "pids"
    make_suite(
        {
            "test_hang.py": f"""
            import subprocess, sys, time

            def test_spawns_and_hangs():
                code = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); open({str(pids)!r}, 'a').write(str(p.pid) + chr(10)); time.sleep(600)"
                child = subprocess.Popen([sys.executable, "-c", code])
                open({str(pids)!r}, "a").write(str(child.pid) + chr(10))
                time.sleep(600)
        """,
            "test_quick.py": "def test_quick():\n    pass\n",
        }
    )
    started = time.monotonic()
    result = run_gpusched("run", ".", "--timeout", "3", "--kill-grace", "1", "--junitxml", "j.xml")
    assert time.monotonic() - started < 300  # the 600 s sleeps were cut short
    assert result.returncode == 1, result.stdout
    assert "TIMEOUT     test_hang.py" in result.stdout
    assert "timed out after 3s in test_hang.py::test_spawns_and_hangs" in result.stdout
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 2
    for pid in recorded:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "j.xml").getroot()}
    assert suites["test_hang.py"].get("errors") == "1"
    assert suites["test_hang.py"].find("testcase/error").get("type") == "timeout"


def test_empty_directory_exits_5(tmp_path, run_gpusched):
    (tmp_path / "empty").mkdir()
    result = run_gpusched("run", "empty")
    assert result.returncode == 5
    assert "no tests collected" in result.stdout
    assert result.stdout.splitlines()[-1] == "gpusched: 0 passed, 0 failed, 0 skipped"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", ".", "--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["run", ".", "--simulate-gpus", "0:80GB,x"], "--simulate-gpus '0:80GB,x'"),
        (
            ["run", ".", "--simulate-gpus", "2", "--gpus", "5"],
            "--gpus names card(s) 5 that do not exist",
        ),
        (["run", "missing_dir"], "path 'missing_dir' does not exist"),
        (["run", ".", "--timeout", "-3"], "--timeout: '-3' must be a positive number"),
    ],
)
def test_bad_input_exits_4_with_a_clear_error(args, message, make_suite, run_gpusched):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    result = run_gpusched(*args)
    assert result.returncode == 4, result.stdout + result.stderr
    assert message in result.stderr


def test_a_file_needing_more_cards_than_exist_is_skipped_not_waited_for(make_suite, run_gpusched):
    make_suite(
        {
            "test_big.py": "import pytest\n\n@pytest.mark.gpu8\ndef test_big():\n    pass\n",
            "test_small.py": "import pytest\n\n@pytest.mark.gpu1\ndef test_small():\n    pass\n",
        }
    )
    result = run_gpusched("run", ".", "--simulate-gpus", "2")
    assert result.returncode == 0
    assert "SKIPPED     test_big.py (1 skipped) - needs 8 GPUs, 2 available" in result.stdout
    assert result.stdout.splitlines()[-1] == "gpusched: 1 passed, 0 failed, 1 skipped"


def test_plan_shows_requirements_and_schedule_without_running(make_suite, run_gpusched, tmp_path):
    marker = tmp_path / "ran"
    make_suite(
        {
            "test_two.py": f"import pytest\n\n@pytest.mark.gpu(2)\ndef test_two():\n    open({str(marker)!r}, 'w')\n",
            "test_cpu.py": "def test_cpu():\n    pass\n",
        }
    )
    result = run_gpusched("plan", ".", "--simulate-gpus", "2:80GB")
    assert result.returncode == 0, result.stderr
    assert "test_two.py" in result.stdout and "2 GPUs" in result.stdout
    assert "[gpu 0,1]  test_two.py" in result.stdout
    assert "[cpu]  test_cpu.py" in result.stdout
    assert "predicted makespan" in result.stdout
    assert not marker.exists()


def test_a_mixed_file_too_big_for_the_node_still_runs_its_cpu_tests(make_suite, run_gpusched):
    make_suite(
        {
            "test_mixed.py": """
            import pytest

            def test_cpu_part():
                pass

            @pytest.mark.gpu2
            def test_needs_two():
                pass
        """,
        }
    )
    result = run_gpusched("run", ".")
    assert result.returncode == 0, result.stdout
    assert "PASSED      test_mixed.py [cpu]" in result.stdout
    assert result.stdout.splitlines()[-1] == "gpusched: 1 passed, 0 failed, 1 skipped"
