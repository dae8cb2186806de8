"""Duration history: format, merging, expectations, corrupt files and concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import hang_guard

from gpusched.history import (
    DEFAULT_SECONDS,
    Entry,
    HistoryError,
    Observation,
    combine,
    dump_history,
    expected_durations,
    history_key,
    load_history,
    measured_cpu,
    merge,
    observations,
    parse_history,
    record_durations,
    with_seed,
)
from gpusched.results import FileResult, Outcome


def test_dump_then_parse_gives_the_same_entries():
    history = {"tests/a.py": Entry(2.5, 3.0, 4), "b.py": Entry(0.125, 0.125, 1)}
    text = dump_history(history)
    assert json.loads(text)["version"] == 1
    assert list(json.loads(text)["files"]) == ["b.py", "tests/a.py"]  # sorted keys
    assert parse_history(text) == history


def test_merge_takes_a_new_file_as_is_and_moves_a_known_one_halfway():
    history = {"a.py": Entry(10.0, 10.0, 3)}
    merged = merge(history, {"a.py": Observation(4.0), "b.py": Observation(2.0)})
    assert merged == {"a.py": Entry(7.0, 4.0, 4), "b.py": Entry(2.0, 2.0, 1)}
    assert history == {"a.py": Entry(10.0, 10.0, 3)}  # input untouched


def test_cpu_figures_are_taken_then_moved_like_the_seconds():
    history = {"a.py": Entry(10.0, 10.0, 3, cpu=2.0, peak=4.0)}
    merged = merge(
        history, {"a.py": Observation(4.0, 1.0, 2.0), "b.py": Observation(2.0, 0.5, 1.5)}
    )
    assert merged["a.py"] == Entry(7.0, 4.0, 4, cpu=1.5, peak=3.0)
    assert merged["b.py"] == Entry(2.0, 2.0, 1, cpu=0.5, peak=1.5)


def test_a_run_that_did_not_measure_cpu_keeps_the_old_figures():
    history = {"a.py": Entry(10.0, 10.0, 3, cpu=2.0, peak=4.0)}
    assert merge(history, {"a.py": Observation(4.0)})["a.py"] == Entry(7.0, 4.0, 4, 2.0, 4.0)


def test_an_old_history_without_cpu_is_read_and_filled_in_as_files_run(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "files": {
                    "a.py": {"seconds": 4.0, "last": 4.0, "runs": 2},
                    "b.py": {"seconds": 6.0, "last": 6.0, "runs": 1},
                },
            }
        ),
        encoding="utf-8",
    )
    history, warning = load_history(path)
    assert warning is None
    assert history == {"a.py": Entry(4.0, 4.0, 2), "b.py": Entry(6.0, 6.0, 1)}
    assert measured_cpu(history, ["a.py", "b.py", "new.py"]) == {
        "a.py": None,
        "b.py": None,
        "new.py": None,
    }
    assert record_durations(path, {"a.py": Observation(2.0, 1.5, 2.5)}) is None
    files = json.loads(path.read_text(encoding="utf-8"))["files"]
    assert files["a.py"] == {"seconds": 3.0, "last": 2.0, "runs": 3, "cpu": 1.5, "peak": 2.5}
    assert files["b.py"] == {"seconds": 6.0, "last": 6.0, "runs": 1}  # not run: no figure yet
    assert measured_cpu(parse_history(path.read_text(encoding="utf-8")), ["a.py"]) == {"a.py": 1.5}


def test_combine_keeps_for_each_file_the_copy_that_saw_most_runs():
    base = {"a.py": Entry(1.0, 1.0, 1), "b.py": Entry(2.0, 2.0, 1)}
    shard1 = merge(base, {"a.py": Observation(3.0)})
    shard2 = merge(base, {"b.py": Observation(6.0), "c.py": Observation(5.0)})
    combined = combine([shard1, shard2])
    assert combined == {"a.py": shard1["a.py"], "b.py": shard2["b.py"], "c.py": shard2["c.py"]}


def test_unknown_files_get_the_mean_of_the_known_ones():
    history = {"a.py": Entry(2.0, 2.0, 1), "b.py": Entry(6.0, 6.0, 1), "x.py": Entry(100, 100, 1)}
    assert expected_durations(history, ["a.py", "b.py", "new.py"]) == {
        "a.py": 2.0,
        "b.py": 6.0,
        "new.py": 4.0,  # mean over the requested files the history knows, not x.py
    }
    # None of the requested files known: the mean of the whole history.
    assert expected_durations(history, ["new.py"]) == {"new.py": 36.0}
    assert expected_durations({}, ["new.py"]) == {"new.py": DEFAULT_SECONDS}


def test_observations_keep_files_that_ran_to_an_end(tmp_path):
    def result(name, outcome, start=0.0, end=2.0):
        return FileResult(str(tmp_path / name), outcome, start=start, end=end)

    results = [
        result("pass.py", Outcome.PASSED),
        result("fail.py", Outcome.FAILED, 1.0, 4.5),
        result("timeout.py", Outcome.TIMEOUT),
        result("interrupted.py", Outcome.INTERRUPTED),
        result("notrun.py", Outcome.NOT_RUN, 0.0, 0.0),
        result("skipped.py", Outcome.SKIPPED, 0.0, 0.0),
    ]
    results[0].cpu, results[0].cpu_peak = 1.25, 3.0
    assert observations(results, str(tmp_path)) == {
        "pass.py": Observation(2.0, 1.25, 3.0),
        "fail.py": Observation(3.5),
        "timeout.py": Observation(2.0),
    }


def test_history_key_is_relative_to_rootdir_and_absolute_outside(tmp_path):
    assert history_key(str(tmp_path / "tests" / "t.py"), str(tmp_path)) == "tests/t.py"
    outside = tmp_path.parent / "elsewhere.py"
    assert history_key(str(outside), str(tmp_path)) == outside.as_posix()


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "not a JSON object"),
        ('{"version": 2, "files": {}}', "version is 2"),
        ('{"version": 1}', '"files" is missing'),
        ('{"version": 1, "files": {"a.py": 3}}', "entry 'a.py' is not an object"),
        (
            '{"version": 1, "files": {"a.py": {"seconds": -1, "last": 1, "runs": 1}}}',
            "entry 'a.py': seconds is -1",
        ),
        (
            '{"version": 1, "files": {"a.py": {"seconds": "1", "last": 1, "runs": 1}}}',
            "entry 'a.py': seconds is '1', not a number",
        ),
        (
            '{"version": 1, "files": {"a.py": {"seconds": 1, "last": 1, "runs": 0}}}',
            "entry 'a.py': runs is 0",
        ),
        (
            '{"version": 1, "files": {"a.py": {"seconds": 1, "last": 1, "runs": 1, "cpu": "x"}}}',
            "entry 'a.py': cpu is 'x', not a number",
        ),
        (
            '{"version": 1, "files": {"a.py": {"seconds": 1, "last": 1, "runs": 1, "peak": -2}}}',
            "entry 'a.py': peak is -2",
        ),
    ],
)
def test_a_malformed_file_is_an_error_that_says_what_is_wrong(text, complaint):
    with pytest.raises(HistoryError, match=complaint.replace("(", r"\(")):
        parse_history(text)


def test_a_missing_file_is_an_empty_history_without_warning(tmp_path):
    assert load_history(tmp_path / "durations.json") == ({}, None)


def test_a_corrupt_file_is_reported_and_replaced(tmp_path):
    path = tmp_path / ".gpusched" / "durations.json"
    path.parent.mkdir()
    path.write_text('{"version": 1, "files": {"a.py": {"seconds": "x"', encoding="utf-8")
    history, warning = load_history(path)
    assert history == {}
    assert str(path) in warning and "corrupt" in warning and "not valid JSON" in warning
    warning = record_durations(path, {"b.py": Observation(1.5)})
    assert "corrupt" in warning
    assert parse_history(path.read_text(encoding="utf-8")) == {"b.py": Entry(1.5, 1.5, 1)}
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "durations.json",
        "durations.json.lock",
    ]


def _writer(path: str, worker: int, rounds: int) -> None:
    for n in range(rounds):
        record_durations(
            path, {f"w{worker}_{n}.py": Observation(float(n)), "shared.py": Observation(1.0)}
        )


def test_concurrent_writers_lose_no_entry(tmp_path):
    path = str(tmp_path / "durations.json")
    workers, rounds = 4, 15
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_writer, args=(path, w, rounds)) for w in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(hang_guard(60))
        assert process.exitcode == 0
    history, warning = load_history(path)
    assert warning is None
    assert history["shared.py"].runs == workers * rounds
    assert {key for key in history if key != "shared.py"} == {
        f"w{w}_{n}.py" for w in range(workers) for n in range(rounds)
    }


def test_merge_command_joins_shard_histories(tmp_path):
    base = {"a.py": Entry(1.0, 1.0, 1), "b.py": Entry(1.0, 1.0, 1)}
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(dump_history(merge(base, {"a.py": Observation(5.0)})), encoding="utf-8")
    two.write_text(dump_history(merge(base, {"b.py": Observation(9.0)})), encoding="utf-8")
    out = tmp_path / "out" / "durations.json"
    done = subprocess.run(
        [sys.executable, "-m", "gpusched.history", "merge", "-o", str(out), str(one), str(two)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "2 files" in done.stdout
    merged = parse_history(Path(out).read_text(encoding="utf-8"))
    assert merged["a.py"].last == 5.0 and merged["b.py"].last == 9.0


def test_a_seed_fills_in_only_the_files_the_history_lacks():
    local = {"a.py": Entry(2.0, 2.0, 3)}
    seed = {"a.py": Entry(50.0, 50.0, 9), "b.py": Entry(30.0, 30.0, 1)}
    assert with_seed(local, seed) == {"a.py": Entry(2.0, 2.0, 3), "b.py": Entry(30.0, 30.0, 1)}


def _seed_file(path: Path, seconds: dict[str, float]) -> Path:
    path.write_text(dump_history({k: Entry(v, v, 1) for k, v in seconds.items()}))
    return path


def test_a_first_run_with_a_seed_starts_the_longest_seeded_file_first(tmp_path, run_gpusched):
    """No .gpusched/ yet (a fresh clone, a CI job without a cache), two CPU slots: without the
    seed the files start in file order; with it, the file the seed knows as long starts first.

    Two slots, not one: collection keeps one and the seed's longest file starts early on the
    other, so the order does not depend on whether the streaming collection reports both files
    before the runner first schedules (with one slot, the first file found could start at once).
    """
    for name in ("test_a.py", "test_z.py"):
        (tmp_path / name).write_text("def test_it():\n    pass\n")
    seed = _seed_file(tmp_path / "durations.json", {"test_a.py": 1.0, "test_z.py": 60.0})

    def starts(*args: str) -> list[str]:
        done = run_gpusched("run", ".", "--cpu-slots", "2", *args, timeout=hang_guard(120))
        assert done.returncode == 0, done.stdout + done.stderr
        shutil.rmtree(tmp_path / ".gpusched")
        return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("START")]

    assert starts() == ["test_a.py", "test_z.py"]
    assert starts("--durations-seed", str(seed)) == ["test_z.py", "test_a.py"]
    assert json.loads(seed.read_text())["files"]["test_z.py"]["runs"] == 1  # never written


@pytest.mark.parametrize(
    ("content", "complaint"),
    [(None, "no such file"), ("{not json", "is not a durations file")],
)
def test_a_bad_seed_is_a_usage_error_naming_it(tmp_path, run_gpusched, content, complaint):
    seed = tmp_path / "seed.json"
    if content is not None:
        seed.write_text(content)
    (tmp_path / "test_a.py").write_text("def test_it():\n    pass\n")
    done = run_gpusched("run", ".", "--durations-seed", str(seed), timeout=hang_guard(60))
    assert done.returncode == 4, done.stdout + done.stderr
    assert (
        "--durations-seed" in done.stderr + done.stdout and complaint in done.stderr + done.stdout
    )
    assert str(seed) in done.stderr + done.stdout
