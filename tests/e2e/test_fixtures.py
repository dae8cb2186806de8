"""Tests of the e2e fixtures themselves, against real Ray clusters and real process groups.

What workers see is proved from inside the workers: actors report their
``os.environ`` and pid, and the extra setup hook (this very file, loaded by path
in each worker although it is not on the worker's ``sys.path``) leaves one file
per worker process.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

THIS_FILE = Path(__file__).resolve()
pytest_plugins = ["pytester"]

HOOK_DIR_VAR = "TRAINER_TEST_HOOK_DIR"  # forwarded to workers by the TRAINER_ prefix
HF_HOME_VALUE = "/nonexistent/hf-home-forwarded-by-the-runtime-env"

FORWARDED = {
    "HF_HOME": HF_HOME_VALUE,
    "TRAINER_EXTRA_WORKER_SETUP_HOOK": f"{THIS_FILE}:record_pid_hook",
}
EXCLUDED_AND_FAILING = {
    "HF_HOME": HF_HOME_VALUE,
    "TRAINER_EXCLUDE": " VLLM* , HF_* ",
    "TRAINER_EXTRA_WORKER_SETUP_HOOK": f"{THIS_FILE}:failing_hook",
}


def record_pid_hook() -> None:
    """Extra worker setup hook: leave ``ran-<pid>`` in the hook directory."""
    (Path(os.environ[HOOK_DIR_VAR]) / f"ran-{os.getpid()}").touch()


def failing_hook() -> None:
    """Extra worker setup hook that records its attempt, then fails."""
    (Path(os.environ[HOOK_DIR_VAR]) / f"attempt-{os.getpid()}").touch()
    raise RuntimeError("this hook fails on purpose")


# Half a CPU each: two probes and a task fit on the 2-CPU cluster at once.
@ray.remote(num_cpus=0.5)
class Probe:
    """An actor that reports what its worker process sees."""

    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)


@ray.remote(num_cpus=1)
def task_pid() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def e2e_ray_host_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every cluster in this module tells its hooks where to write."""
    return {HOOK_DIR_VAR: str(tmp_path_factory.mktemp("hooks"))}


@pytest.fixture(scope="class")
def probes(e2e_ray) -> Iterator[list]:
    """Two probes for the tests of a class: each is a worker process of the class's cluster,
    started with its runtime env (and hook), and only reports; one per test cost a worker
    process each. Up before a test's leftovers snapshot (which would otherwise kill a probe
    still being created as the test's own), killed when the class ends."""
    made = [Probe.remote() for _ in range(2)]
    ray.get([probe.pid.remote() for probe in made])
    yield made
    for probe in made:
        ray.kill(probe)


@pytest.mark.parametrize("e2e_ray", [{"host_env": FORWARDED}], indirect=True, ids=["fwd"])
class TestForwardedEnvAndHook:
    def test_forwarded_hf_home_reaches_worker(self, e2e_ray, probes):
        probe = probes[0]
        assert ray.get(probe.env.remote("HF_HOME")) == HF_HOME_VALUE

    def test_defaults_reach_worker(self, e2e_ray, probes):
        probe = probes[1]
        env_vars = e2e_ray.runtime_env["env_vars"]
        for name in ("NCCL_DEBUG", "TOKENIZERS_PARALLELISM", "NCCL_CUMEM_ENABLE"):
            assert ray.get(probe.env.remote(name)) == env_vars[name], name

    def test_extra_hook_runs_in_every_worker(self, e2e_ray, e2e_ray_host_env, probes):
        pids = set(ray.get([p.pid.remote() for p in probes]))
        pids |= set(ray.get([task_pid.remote() for _ in range(4)]))
        ran = {
            int(p.name.split("-")[1]) for p in Path(e2e_ray_host_env[HOOK_DIR_VAR]).glob("ran-*")
        }
        assert len(pids) >= 2
        assert pids <= ran, f"workers {sorted(pids - ran)} did not run the hook"

    def test_ray_address_is_not_set_while_running(self, e2e_ray):
        assert "RAY_ADDRESS" not in os.environ
        assert len(str(e2e_ray.temp_dir)) <= 40


@pytest.mark.parametrize(
    "e2e_ray", [{"host_env": EXCLUDED_AND_FAILING}], indirect=True, ids=["excl"]
)
class TestExcludedEnvAndFailingHook:
    def test_excluded_hf_home_does_not_reach_worker(self, e2e_ray, probes):
        assert "HF_HOME" not in e2e_ray.runtime_env["env_vars"]
        probe = probes[0]
        assert ray.get(probe.env.remote("HF_HOME")) != HF_HOME_VALUE

    def test_failing_hook_leaves_workers_alive(self, e2e_ray, e2e_ray_host_env, probes):
        pids = ray.get([p.pid.remote() for p in probes])
        # Alive: each actor answers again after its hook failed.
        assert ray.get([p.pid.remote() for p in probes]) == pids
        attempted = {
            int(p.name.split("-")[1])
            for p in Path(e2e_ray_host_env[HOOK_DIR_VAR]).glob("attempt-*")
        }
        assert set(pids) <= attempted, "the failing hook did not run in every actor"


def _all_reduce_rank_plus_one(rank: int, world_size: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return dist.get_world_size(), value.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails on purpose")


def test_distributed_runs_a_collective_on_every_rank(e2e_distributed):
    assert e2e_distributed(_all_reduce_rank_plus_one, 2) == [(2, 3.0), (2, 3.0)]


def test_distributed_reraises_with_the_rank(e2e_distributed):
    from rl_e2e.distributed import DistributedRankError

    with pytest.raises(DistributedRankError, match="rank 1") as info:
        e2e_distributed(_fail_on_rank_one, 2)
    assert info.value.rank == 1
    assert "rank one fails on purpose" in str(info.value)


_INNER_TESTS = """
    import json, os
    from pathlib import Path

    def test_cluster_then_fail(e2e_ray):
        Path(os.environ["OUT"]).write_text(json.dumps(
            {"temp_dir": str(e2e_ray.temp_dir),
             "ray_address": os.environ.get("RAY_ADDRESS")}))
        assert False, "fails on purpose"

    def test_gpu_cluster(e2e_ray_gpu1):
        pass

    def test_gpu_distributed(e2e_distributed_gpu2):
        pass
"""


def _ray_processes_under(temp_dir: str) -> list[str]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if temp_dir in cmdline:
            found.append(f"{proc.pid}: {cmdline[:120]}")
    return found


def test_cluster_stops_when_its_test_fails_and_gpu_variants_skip(pytester, monkeypatch):
    """A failing test still shuts its cluster down; the GPU fixtures skip on CPU and are
    marked at collection (``-m gpu2`` selects them)."""
    pytester.makeconftest('pytest_plugins = ["rl_e2e.plugin"]')
    pytester.makeini("[pytest]\nrl_e2e_runtime_env = trainer.launch.runtime_env:get_runtime_env\n")
    pytester.makepyfile(test_inner=textwrap.dedent(_INNER_TESTS))
    out = pytester.path / "out.json"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # would hang ray.init if kept
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU behaviour on any machine
    # Without the gpusched plugin, whose own "needs N GPUs" skip would come first:
    # this checks the fixtures' skip.
    result = pytester.runpytest_subprocess(
        "-rs", "-p", "no:cacheprovider", "-p", "no:gpusched", timeout=120
    )
    result.assert_outcomes(failed=1, skipped=2)
    result.stdout.re_match_lines([r".*needs 1 CUDA GPU.*", r".*needs 2 CUDA GPU.*"])
    seen = json.loads(out.read_text())
    assert seen["ray_address"] is None
    assert not Path(seen["temp_dir"]).exists(), "temp dir left behind"
    assert _ray_processes_under(seen["temp_dir"]) == []

    from deadlines import hang_guard  # here: Ray workers import this file as the hook

    selected = pytester.runpytest_subprocess(
        "--collect-only", "-q", "-m", "gpu2", timeout=hang_guard(60)
    )
    selected.stdout.fnmatch_lines(["*test_gpu_distributed*", "*1/3 tests collected*"])
