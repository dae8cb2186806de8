"""CI sharding by GPU count: classes, balancing, and the shard/matrix commands."""

from __future__ import annotations

import json
import random

import pytest

from gpusched import cli
from gpusched.history import Entry, dump_history
from gpusched.scheduling.shard import (
    RunnerClass,
    ShardError,
    SuiteFile,
    balance,
    class_of,
    matrix,
    parse_sizes,
    runner_classes,
    select,
    suite_sizes,
)


def files(*specs: tuple[str, int, float]) -> list[SuiteFile]:
    return [SuiteFile(key, gpus, expected) for key, gpus, expected in specs]


def test_classes_cover_the_gaps_between_runner_sizes():
    classes = runner_classes([8, 0, 2, 1])
    assert classes == [
        RunnerClass(0, 0),
        RunnerClass(1, 1),
        RunnerClass(2, 2),
        RunnerClass(8, 3),
    ]
    assert [class_of(n, classes).gpus for n in range(9)] == [0, 1, 2, 8, 8, 8, 8, 8, 8]
    assert classes[3].describe() == "files needing 3-8 GPUs" and classes[3].name == "gpu8"
    # Without a CPU runner, CPU files run on the smallest GPU runners.
    assert class_of(0, runner_classes([1, 4])).gpus == 1


def test_files_too_big_for_every_runner_go_to_the_largest_class():
    classes = runner_classes([0, 2])
    assert class_of(8, classes) == classes[-1]


def test_default_sizes_are_the_gpu_counts_of_the_suite():
    suite = files(("a", 0, 1.0), ("b", 4, 1.0), ("c", 1, 1.0), ("d", 4, 1.0))
    assert suite_sizes(suite) == (0, 1, 4)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [("0,x", "expected card counts"), ("", "names no runner size"), ("1,-2", "negative"),
     ("1,1", "named twice")],
)  # fmt: skip
def test_bad_runner_sizes_are_named(text, complaint):
    with pytest.raises(ShardError, match=complaint):
        parse_sizes(text)


def test_balance_puts_the_longest_file_into_the_least_loaded_shard():
    suite = files(("a", 1, 8.0), ("b", 1, 7.0), ("c", 1, 6.0), ("d", 1, 5.0), ("e", 1, 4.0))
    shards = balance(suite, 2)
    # 8 -> 0; 7 -> 1; 6 -> 1 (7 < 8); 5 -> 0 (8 < 13); 4 -> 0 (13 = 13, lower index wins)
    assert [[f.key for f in shard] for shard in shards] == [["a", "d", "e"], ["b", "c"]]


def test_select_rejects_a_runner_size_that_is_no_class_and_a_bad_index():
    classes = runner_classes([0, 1, 8])
    suite = files(("a", 1, 1.0))
    with pytest.raises(ShardError, match="--gpus-per-runner 4: no runner class.*0,1,8"):
        select(suite, classes, 4)
    with pytest.raises(ShardError, match="--index 3: must be in 0..2"):
        select(suite, classes, 1, shards=3, index=3)
    with pytest.raises(ShardError, match="--shards 0"):
        select(suite, classes, 1, shards=0)


def random_suites(seed: int, count: int = 300):
    """Seeded random suites (0 to 40 files, 0 to 10 GPUs each), with runner sizes and K."""
    rng = random.Random(seed)
    for _ in range(count):
        suite = [
            SuiteFile(f"f{i}.py", rng.randint(0, 10), rng.uniform(0.01, 100.0))
            for i in range(rng.randint(0, 40))
        ]
        sizes = rng.sample(range(9), rng.randint(1, 5))
        yield suite, sizes, rng.randint(1, 6)


@pytest.mark.parametrize("seed", range(3))
def test_every_file_lands_in_exactly_one_shard_of_exactly_one_class(seed):
    for suite, sizes, shards in random_suites(seed):
        classes = runner_classes(sizes)
        seen: list[str] = []
        for runner in classes:
            for index in range(shards):
                seen += [f.key for f in select(suite, classes, runner.gpus, shards, index)]
        assert sorted(seen) == sorted(f.key for f in suite)  # union is the suite, no duplicates
        from_matrix = [key for entry in matrix(suite, classes, shards) for key in entry.files]
        assert sorted(from_matrix) == sorted(f.key for f in suite)


@pytest.mark.parametrize("seed", range(3))
def test_balanced_shards_stay_within_the_greedy_bound(seed):
    for suite, _, shards in random_suites(seed):
        if not suite:
            continue
        loads = [sum(f.expected for f in shard) for shard in balance(suite, shards)]
        total, longest = sum(f.expected for f in suite), max(f.expected for f in suite)
        # The fullest shard's last file went into the least loaded shard, then at most
        # (total - it) / shards full: greedy stays within total / shards + (1 - 1/shards) longest.
        assert max(loads) <= total / shards + (1 - 1 / shards) * longest + 1e-9
        assert sum(loads) == pytest.approx(total)


def test_matrix_has_one_entry_per_non_empty_class_and_shard():
    suite = files(("a", 0, 1.0), ("b", 0, 2.0), ("c", 0, 3.0), ("d", 2, 1.0), ("e", 8, 5.0))
    entries = matrix(suite, runner_classes([0, 1, 2, 8]), max_shards=2)
    rows = [entry.to_json((0, 1, 2, 8)) for entry in entries]
    assert [(r["name"], r["gpus"], r["index"], r["shards"], r["files"]) for r in rows] == [
        ("cpu-1of2", 0, 0, 2, 1),  # c (3 s) alone
        ("cpu-2of2", 0, 1, 2, 2),  # b and a (3 s)
        ("gpu2-1of1", 2, 0, 1, 1),  # one file: one shard
        ("gpu8-1of1", 8, 0, 1, 1),  # nothing needs 1 GPU: no gpu1 entry
    ]
    assert {r["runner_sizes"] for r in rows} == {"0,1,2,8"}


# ---- the commands, on a real suite (one collection subprocess each) ----------------------


@pytest.fixture
def suite_dir(tmp_path, monkeypatch):
    needs = {"cpu_a": 0, "cpu_b": 0, "cpu_c": 0, "one": 1, "two": 2, "four": 4, "eight": 8}
    for name, gpus in needs.items():
        marker = f"pytestmark = pytest.mark.gpu({gpus})\n" if gpus else ""
        (tmp_path / f"test_{name}.py").write_text(
            f"import pytest\n{marker}\ndef test_it():\n    pass\n", encoding="utf-8"
        )
    (tmp_path / "test_broken.py").write_text("import nonexistent_module_xyz\n", encoding="utf-8")
    history = {
        f"test_{name}.py": Entry(float(i + 1), float(i + 1), 1) for i, name in enumerate(needs)
    }
    (tmp_path / ".gpusched").mkdir()
    (tmp_path / ".gpusched" / "durations.json").write_text(dump_history(history), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_shard_command_splits_the_suite_by_runner_class(suite_dir, capsys):
    code = cli.main(["matrix", ".", "--runner-sizes", "0,1,2,8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    include = json.loads(out)["include"]
    printed: list[str] = []
    for entry in include:
        code = cli.main(
            ["shard", ".", "--runner-sizes", entry["runner_sizes"],
             "--gpus-per-runner", str(entry["gpus"]),
             "--shards", str(entry["shards"]), "--index", str(entry["index"])]
        )  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        lines = out.split()
        assert len(lines) == entry["files"]
        printed += lines
    everything = sorted(p.name for p in suite_dir.glob("test_*.py"))
    assert sorted(printed) == everything  # the broken file too: it lands on a CPU shard
    assert [(e["name"], e["files"]) for e in include] == [
        ("cpu-1of1", 4),
        ("gpu1-1of1", 1),
        ("gpu2-1of1", 1),
        ("gpu8-1of1", 2),
    ]


def test_shard_run_runs_only_its_files(suite_dir, capsys):
    code = cli.main(
        ["shard", ".", "--runner-sizes", "0,1,2,8", "--gpus-per-runner", "8", "--run",
         "--simulate-gpus", "8", "--json", "r.json"]
    )  # fmt: skip
    out, _ = capsys.readouterr()
    assert code == 0, out
    report = json.loads((suite_dir / "r.json").read_text(encoding="utf-8"))
    ran = sorted(
        (f["path"].rsplit("/", 1)[-1], f["outcome"], len(f["cards"])) for f in report["files"]
    )
    assert ran == [("test_eight.py", "PASSED", 8), ("test_four.py", "PASSED", 4)]
    assert out.splitlines()[-1] == "gpusched: 2 passed, 0 failed, 0 skipped"


def test_shard_bad_input_exits_4_naming_it(suite_dir, capsys):
    assert cli.main(["shard", ".", "--gpus-per-runner", "3"]) == 4
    assert "--gpus-per-runner 3: no runner class" in capsys.readouterr().err
    assert cli.main(["shard", ".", "--gpus-per-runner", "x"]) == 4
    assert "--gpus-per-runner: invalid int value: 'x'" in capsys.readouterr().err
    assert cli.main(["matrix", "missing_dir"]) == 4
    assert "path 'missing_dir' does not exist" in capsys.readouterr().err
