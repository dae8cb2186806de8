"""Acceptance: one combined report under ``gpusched run -- --cov`` for every place a test's code
runs: the file's own process, a GPU file, a Ray task, a Ray actor (``__init__`` included) and
two ``torch.distributed`` ranks, with the rl_e2e plugin on (as a user's repository has it).

The same project under plain ``pytest --cov`` covers the same lines but the GPU file's, which
skips there (no card is visible).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import coverage
import pytest
from deadlines import hang_guard

from rl_e2e.coverage import WORKER_CONTEXT

WORK = """\
import os


def in_test(x):
    return x * 2  # test


def in_gpu_file():
    return os.environ["CUDA_VISIBLE_DEVICES"]  # gpu


def in_task(x):
    return x + 1  # task


class Counter:
    def __init__(self, start):
        self.value = start  # actor init

    def bump(self):
        self.value += 1  # actor method
        return self.value  # actor method


def in_rank(rank, world_size):
    import torch.distributed as dist

    total = [rank]  # rank
    dist.barrier()  # rank
    return total[0]  # rank


def never():
    return "no test calls this"  # never
"""

CPU_TESTS = """\
import ray

from pkg import work


def test_in_test_process():
    assert work.in_test(2) == 4


def test_task_and_actor(e2e_ray):
    assert ray.get(ray.remote(work.in_task).remote(1)) == 2
    counter = ray.remote(work.Counter).remote(5)
    assert ray.get(counter.bump.remote()) == 6


def test_ranks(e2e_distributed):
    assert e2e_distributed(work.in_rank, 2) == [0, 1]
"""

GPU_TESTS = """\
import pytest

from pkg import work

pytestmark = pytest.mark.gpu1


def test_on_its_card():
    assert work.in_gpu_file() == "0"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("covered")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "work.py").write_text(WORK)
    (root / "test_cpu.py").write_text(CPU_TESTS)
    (root / "test_gpu.py").write_text(GPU_TESTS)
    (root / "conftest.py").write_text('pytest_plugins = ["rl_e2e.plugin"]\n')
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return root


def lines_marked(*markers: str) -> set[int]:
    found = set()
    for number, line in enumerate(WORK.splitlines(), 1):
        if any(line.endswith(f"# {marker}") for marker in markers):
            found.add(number)
    return found


def missing(project: Path) -> set[int]:
    """The lines of ``pkg/work.py`` the project's ``.coverage`` does not cover."""
    cov = coverage.Coverage(data_file=str(project / ".coverage"), config_file=False)
    cov.load()
    measured = cov.get_data().measured_files()
    assert all(Path(name).is_relative_to(project) for name in measured), measured
    return set(cov.analysis2(str(project / "pkg" / "work.py"))[3])


def run(project: Path, *command: str) -> subprocess.CompletedProcess:
    for path in project.glob(".coverage*"):
        path.unlink()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COVERAGE_", "GPUSCHED_", "CUDA_VISIBLE", "PYTEST_ADDOPTS"))
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=hang_guard(120)
    )


def test_gpusched_reports_the_process_gpu_file_task_actor_and_ranks_once(project):
    done = run(
        project,
        sys.executable, "-m", "gpusched", "run", ".", "--simulate-gpus", "1",
        "--", "--cov=pkg", "--cov-report=term-missing",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert done.stdout.splitlines()[-1] == "gpusched: 4 passed, 0 failed, 0 skipped", out
    assert done.stdout.count("tests coverage") == 1, out
    assert missing(project) == lines_marked("never"), out
    assert sorted(p.name for p in project.glob(".coverage*")) == [".coverage"]
    # What workers and ranks ran carries their context; the files' own processes, none.
    data = coverage.CoverageData(str(project / ".coverage"))
    data.read()
    contexts = data.contexts_by_lineno(str(project / "pkg" / "work.py"))
    for line in lines_marked("task", "actor init", "actor method", "rank"):
        assert contexts[line] == [WORKER_CONTEXT], (line, contexts)
    for line in lines_marked("test", "gpu"):
        assert contexts[line] == [""], (line, contexts)


def test_plain_pytest_covers_the_same_but_the_skipped_gpu_file(project):
    done = run(project, sys.executable, "-m", "pytest", "--cov=pkg", "-q")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "3 passed, 1 skipped" in out, out
    assert missing(project) == lines_marked("never", "gpu"), out
