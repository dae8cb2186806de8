"""Coverage of what runs in Ray workers, ranks and jobs (``rl_e2e.coverage``), for real.

A small repository in a temp dir has a package whose functions run in the test
process, in a Ray task, in a Ray actor (``__init__`` and a method), on two
gloo ranks and in a submitted job. It is run as its users run it, in a
subprocess (``pytest --cov=pkg``, ``coverage run -m pytest``, no coverage),
and the data it leaves is read with coverage's API: every line that ran is
covered, exactly the lines that did not run are missing, and no path of Ray's
copies is in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rl_e2e.coverage import (
    CONFIG_VARIABLE,
    START_VARIABLE,
    WorkerCoverage,
    check_start_variable,
    copy_roots,
    map_ray_copy,
    package_names,
)

coverage = pytest.importorskip("coverage")
pytest.importorskip("pytest_cov")

WORK = """\
import os


def in_test(x):
    return x * 2


def in_task(x):
    return x + 1


class Counter:
    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value

    def triple(self, x):
        return in_killed_actor(x)


def in_rank(rank, world_size):
    import torch.distributed as dist

    dist.barrier()
    return rank


def in_job(x):
    return x - 1  # job


def in_killed_actor(x):
    return x * 3  # killed


def never_called():
    return os.getpid()  # not run
"""

JOB = """\
import ray

from pkg import work

if __name__ == "__main__":
    ray.init()
    print("job result", ray.get(ray.remote(work.in_job).remote(43)))
"""

# What each place saw: is coverage's variable set, is coverage imported?
PROBE = """\
import os
import sys

from pkg import work


def seen():
    return {"variable": os.environ.get("COVERAGE_PROCESS_CONFIG"), "coverage": "coverage" in sys.modules}


def rank(rank, world_size):
    return work.in_rank(rank, world_size), seen()
"""

TESTS = """\
import json
import os

import ray

from pkg import probe, work


def test_in_test_process():
    assert work.in_test(2) == 4


def test_task_and_actor_left_alive(e2e_ray):
    assert ray.get(ray.remote(work.in_task).remote(1)) == 2
    counter = ray.remote(work.Counter).remote(5)
    assert ray.get(counter.bump.remote()) == 6
    doomed = ray.remote(work.Counter).remote(0)
    assert ray.get(doomed.triple.remote(2)) == 6
    ray.kill(doomed)  # as a trainer shuts its worker groups down
    record(
        "task_and_actor",
        test=probe.seen(),
        task=ray.get(ray.remote(probe.seen).remote()),
        runtime_env=ray.get_runtime_context().runtime_env.get("env_vars", {}),
        cluster_runtime_env=e2e_ray.runtime_env,
    )


def test_ranks(e2e_distributed):
    results = e2e_distributed(probe.rank, 2)
    assert [rank for rank, _ in results] == [0, 1]
    record("ranks", ranks=[seen for _, seen in results])


def record(name, **seen):
    with open(os.path.join(os.environ["SEEN_DIR"], name + ".json"), "w") as out:
        json.dump(seen, out)
"""

JOB_TEST = """\
import os
import sys


def test_job(e2e_ray_job):
    done = e2e_ray_job.submit(
        [sys.executable, "-m", "pkg.job"], runtime_env={"working_dir": os.getcwd()}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job result 42" in done.stdout
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small repository: ``pkg`` and its tests, with the plugin turned on."""
    root = tmp_path_factory.mktemp("covered")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "work.py").write_text(WORK)
    (root / "pkg" / "job.py").write_text(JOB)
    (root / "pkg" / "probe.py").write_text(PROBE)
    (root / "test_work.py").write_text(TESTS)
    (root / "test_job.py").write_text(JOB_TEST)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p rl_e2e.plugin -p no:cacheprovider\n")
    return root


def _run(project: Path, *command: str, seen: Path, data: Path | None = None) -> str:
    """Run ``command`` in the project, in a clean copy of this environment; return its output.

    ``seen``: a directory the tests record what each place saw in; ``data``: the
    session's data file (``COVERAGE_FILE``), default ``.coverage`` there.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    seen.mkdir(exist_ok=True)
    env["SEEN_DIR"] = str(seen)
    if data is not None:
        env["COVERAGE_FILE"] = str(data)
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def _seen(directory: Path) -> dict[str, object]:
    """What the project's tests recorded, all files in one dict."""
    return {
        k: v for path in directory.glob("*.json") for k, v in json.loads(path.read_text()).items()
    }


def _lines(marker: str) -> set[int]:
    return {n for n, line in enumerate(WORK.splitlines(), 1) if line.endswith(f"# {marker}")}


def _missing(project: Path, data: Path | None = None) -> set[int]:
    """The lines of ``pkg/work.py`` the project's combined data does not cover."""
    cov = coverage.Coverage(data_file=str(data or project / ".coverage"), config_file=False)
    cov.load()
    measured = cov.get_data().measured_files()
    assert measured, "no data"
    assert all(Path(name).is_relative_to(project) for name in measured), measured
    _, _, _, missing, _ = cov.analysis2(str(project / "pkg" / "work.py"))
    return set(missing)


def _clean(project: Path) -> None:
    for path in project.glob(".coverage*"):
        path.unlink()


@dataclass
class PytestCovRun:
    """What one ``pytest --cov=pkg`` session of both test files left: its data file (in a
    directory of its own), what else that directory and the project held right after it,
    and what each place saw."""

    data: Path
    beside_data: list[str]
    in_project: list[str]
    seen: dict[str, object]


@pytest.fixture(scope="module")
def pytest_cov_run(project: Path, tmp_path_factory: pytest.TempPathFactory) -> PytestCovRun:
    """``pytest --cov=pkg`` on test_work.py (a task, actors, ranks) and test_job.py (a
    submitted job) in one session, into a data file of the session's own elsewhere, as
    gpusched gives each test file. The tests below read different parts of its data."""
    _clean(project)
    base = tmp_path_factory.mktemp("pytest_cov")
    data = base / "file1" / ".coverage"
    data.parent.mkdir()
    seen_dir = base / "seen"
    command = [sys.executable, "-m", "pytest", "--cov=pkg", "-q", "test_work.py", "test_job.py"]
    _run(project, *command, seen=seen_dir, data=data)
    return PytestCovRun(
        data=data,
        beside_data=[p.name for p in data.parent.iterdir()],
        in_project=[p.name for p in project.glob(".coverage*")],
        seen=_seen(seen_dir),
    )


def test_pytest_cov_covers_the_test_process_a_task_an_actor_and_ranks(project, pytest_cov_run):
    """Into a data file of the session's own elsewhere, as gpusched gives each test file."""
    run = pytest_cov_run
    # Only the line nothing calls is missing (the job's line ran, in the submitted job).
    assert _missing(project, run.data) == _lines("not run")
    # pytest-cov combined the workers', ranks' and job's files: nothing else is left behind.
    assert run.beside_data == [".coverage"]
    assert run.in_project == []
    seen = run.seen
    assert seen["task"]["variable"] and all(rank["variable"] for rank in seen["ranks"])
    assert seen["test"]["variable"] is None  # the test process's own env is left alone
    assert CONFIG_VARIABLE not in seen["cluster_runtime_env"].get("env_vars", {})


def test_coverage_run_covers_the_same_after_combine(project, tmp_path):
    _clean(project)
    (project / ".coveragerc").write_text("[run]\nsource = pkg\n")
    try:
        run = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "test_work.py"]
        _run(project, *run, seen=tmp_path)
        _run(project, sys.executable, "-m", "coverage", "combine", "--append", seen=tmp_path)
    finally:
        (project / ".coveragerc").unlink()
    assert _missing(project) == _lines("not run") | _lines("job")


def test_with_coverage_off_nothing_is_imported_or_set(project, tmp_path):
    _clean(project)
    seen_dir = tmp_path / "seen"
    _run(project, sys.executable, "-m", "pytest", "-q", "test_work.py", seen=seen_dir)
    seen = _seen(seen_dir)
    nothing = {"variable": None, "coverage": False}
    assert seen["test"] == nothing
    assert seen["task"] == {"variable": None, "coverage": False}
    assert seen["ranks"] == [nothing, nothing]
    assert CONFIG_VARIABLE not in seen["runtime_env"]
    assert not list(project.glob(".coverage*"))


def test_a_submitted_job_is_covered_from_ray_s_copy_of_its_working_dir(project, pytest_cov_run):
    # The job's driver ran pkg/job.py and its worker in_job, both from Ray's
    # copy of the working dir: mapped back to the project.
    missing = _missing(project, pytest_cov_run.data)
    assert not missing & _lines("job")
    cov = coverage.Coverage(data_file=str(pytest_cov_run.data), config_file=False)
    cov.load()
    _, statements, _, job_missing, _ = cov.analysis2(str(project / "pkg" / "job.py"))
    assert statements and not job_missing


def test_an_unreadable_start_up_config_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.ini"
    bad.write_text("[run]\nbranch = maybe\n")
    with pytest.raises(ValueError, match=f"^{START_VARIABLE}={bad}: coverage cannot read") as err:
        check_start_variable({START_VARIABLE: str(bad)})
    assert "\n" not in str(err.value)
    check_start_variable({})  # unset: nothing read


def test_the_plugin_refuses_an_unreadable_start_up_config(tmp_path):
    bad = tmp_path / "bad.ini"
    bad.write_text("[run\nsource = pkg\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = {**os.environ, START_VARIABLE: str(bad)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "rl_e2e.plugin", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 4, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR: rl_e2e")]
    assert len(errors) == 1 and str(bad) in errors[0], done.stderr


def test_ray_copies_map_back_to_the_directories_they_came_from(tmp_path):
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "mod.py").write_text("")
    (tmp_path / "mods" / "extra").mkdir(parents=True)
    (tmp_path / "mods" / "extra" / "__init__.py").write_text("")
    runtime_env = {"working_dir": "repo", "py_modules": [str(tmp_path / "mods" / "extra")]}
    roots = copy_roots(runtime_env, cwd=tmp_path)
    assert roots == [tmp_path / "repo", tmp_path / "mods"]
    session = "/tmp/ray/session_1/runtime_resources"
    copy = f"{session}/working_dir_files/_ray_pkg_90a5458c21ff834d/pkg/mod.py"
    module = f"{session}/py_modules_files/_ray_pkg_b568c9b4bb1a4bec/extra/__init__.py"
    assert map_ray_copy(copy, roots) == str(tmp_path / "repo" / "pkg" / "mod.py")
    assert map_ray_copy(module, roots) == str(tmp_path / "mods" / "extra" / "__init__.py")
    assert map_ray_copy(f"{session}/working_dir_files/_ray_pkg_ab/gone.py", roots) is None
    assert map_ray_copy("/elsewhere/pkg/mod.py", roots) == "/elsewhere/pkg/mod.py"
    assert copy_roots({"working_dir": "gcs://_ray_pkg_abc.zip"}) == []


def test_source_directories_are_measured_in_copies_by_package_name(tmp_path):
    (tmp_path / "src" / "pkg" / "sub").mkdir(parents=True)
    for package in ("pkg", "pkg/sub"):
        (tmp_path / "src" / package / "__init__.py").write_text("")
    (tmp_path / "src" / "notes").mkdir()
    assert package_names(tmp_path / "src" / "pkg" / "sub") == ["pkg.sub"]
    assert package_names(tmp_path / "src") == ["pkg"]


def test_a_data_file_that_cannot_be_read_is_left_out_with_a_warning(tmp_path):
    directory = tmp_path / "private"
    directory.mkdir()
    good = coverage.CoverageData(basename=str(directory / ".coverage"), suffix="a.1.x")
    good.add_lines({str(tmp_path / "mod.py"): [1, 2]})
    good.write()
    (directory / ".coverage.b.2.y").write_bytes(b"killed while writing")
    config = coverage.Coverage(config_file=False).config
    measured = WorkerCoverage(directory, tmp_path / ".coverage", config)
    with pytest.warns(UserWarning, match=r"could not read 1 data file\(s\): \.coverage\.b\.2\.y"):
        merged = measured.merge()
    assert merged is not None and merged.parent == tmp_path
    assert merged.name.startswith(".coverage.")
    data = coverage.CoverageData(basename=str(merged))
    data.read()
    assert data.lines(str(tmp_path / "mod.py")) == [1, 2]
    assert not directory.exists()


def test_warm_workers_are_covered_as_cold_ones(project, tmp_path):
    """Ray workers forked from a warm process (rl_e2e_env_warm_preload) measure what they run."""
    _clean(project)
    ini = project / "pytest.ini"
    plain = ini.read_text()
    ini.write_text(plain + "rl_e2e_env_warm_preload = json\n")
    try:
        data = tmp_path / ".coverage"
        seen_dir = tmp_path / "seen"
        command = [sys.executable, "-m", "pytest", "--cov=pkg", "-q", "test_work.py"]
        _run(project, *command, seen=seen_dir, data=data)
    finally:
        ini.write_text(plain)
    assert _missing(project, data) == _lines("not run") | _lines("job")
    runtime_env = _seen(seen_dir)["cluster_runtime_env"]
    assert "worker_shim.py" in runtime_env["py_executable"]  # the workers were started warm
