"""While a run holds a node's cards, Ray knows it: other Ray work cannot be given them.

One node, started with ``ray start --head --num-gpus 2`` and two simulated
cards, so that Ray counts the same two GPUs as gpusched. Another Ray driver
(a subprocess here, as another team's job would be) asks for a GPU there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from deadlines import hang_guard, wait_until

from conftest import (
    gpusched,
    recording_file,
    records,
    start_gpusched,
    started,
    started_cluster,
    write_suite,
)

GPU_NODE = ({"GPUSCHED_SIMULATE_GPUS": "2", "--num-gpus": "2"},)

# Another Ray job: one task that needs a GPU. It prints "queued" once Ray's GCS lists the
# task among the demands it cannot place yet ("ran at once" if it ran first), then when
# the task started and which card it got.
TASK = """
import json, os, sys, time
import ray
from ray.autoscaler.v2.sdk import get_cluster_resource_state

ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")

@ray.remote(num_gpus=1, num_cpus=0)
def use_a_card():
    return {"start": time.time(), "cards": os.environ.get("CUDA_VISIBLE_DEVICES")}

def queued():
    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    return any(d.request.resources_bundle.get("GPU") for d in state.pending_resource_requests)

card = use_a_card.remote()
while not ray.wait([card], timeout=0.05)[0]:
    if queued():
        print("queued", flush=True)
        break
else:
    print("ran at once", flush=True)
print(json.dumps(ray.get(card)), flush=True)
ray.shutdown()
"""

# Another Ray job that holds one GPU until its standard input closes.
HOLDER = """
import sys
import ray

ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")

@ray.remote(num_gpus=1, num_cpus=0)
class Holder:
    def ready(self):
        return True

holder = Holder.remote()
ray.get(holder.ready.remote())
print("holding", flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def gpu_cluster_shared():
    with started_cluster(GPU_NODE) as cluster:
        yield cluster


def _ray_job(cluster, source: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", source, cluster.address],
        env=cluster.env(RAY_AUTH_MODE="token"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_ray_task_for_a_gpu_waits_until_the_run_releases_the_cards(gpu_cluster_shared, tmp_path):
    cluster = gpu_cluster_shared
    release = tmp_path / "release"  # the file holds its card until the test creates this
    write_suite(tmp_path, {"test_long.py": recording_file(tmp_path, 1, 0, release=release)})
    run = start_gpusched(tmp_path, "run", ".", "--ray", cluster.address, env=cluster.env())
    task = None
    try:
        wait_until(lambda: started(tmp_path) or run.poll() is not None, 90, "the file to start")
        assert started(tmp_path), (tmp_path / "gpusched.out").read_text()
        task = _ray_job(cluster, TASK)
        # Ray holds the task back while the run has the cards, so the file ends only then.
        assert task.stdout.readline().strip() == "queued"
        release.touch()
        code = run.wait(timeout=hang_guard(90))
        answer = json.loads(task.stdout.readline())
        task.wait(timeout=hang_guard(60))
    finally:
        for proc in (run, task):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    out = (tmp_path / "gpusched.out").read_text()
    assert code == 0, out
    (record,) = records(tmp_path)
    # Ray started the task only once the run (its agent's actor) had let the cards go.
    assert answer["start"] > record["end"], (answer, record)
    assert answer["cards"] in {"0", "1"}


def test_cards_other_ray_work_holds_are_not_used(gpu_cluster_shared, tmp_path):
    cluster = gpu_cluster_shared
    write_suite(
        tmp_path, {"test_a.py": "import pytest\n\n@pytest.mark.gpu(1)\ndef test_a():\n    pass\n"}
    )
    holder = _ray_job(cluster, HOLDER)
    try:
        assert holder.stdout.readline().strip() == "holding"
        result = gpusched(tmp_path, "plan", ".", "--ray", cluster.address, env=cluster.env())
    finally:
        holder.stdin.close()
        holder.wait(timeout=hang_guard(60))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "(1 simulated cards, " in result.stdout, out
    assert ": 1 of its GPUs are held by other Ray work; this run uses the other 1" in out


pytestmark = pytest.mark.filterwarnings("ignore")
