"""Real multi-node Ray clusters on this machine, for ``gpusched run --ray``.

Each node is its own raylet (``ray.cluster_utils.Cluster``) and declares its
own simulated cards with ``GPUSCHED_SIMULATE_GPUS`` in its environment, as a
node of a real cluster would in the environment of its ``ray start``. Nodes
have one CPU each: a CPU slot per node, and little load on a small machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# A removed node is noticed in about a second and a half, not the default fifteen.
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
# The shared cluster of the example: 2 nodes with 4 cards, 1 node with 2.
SHAPE = (
    {"GPUSCHED_SIMULATE_GPUS": "4"},
    {"GPUSCHED_SIMULATE_GPUS": "4"},
    {"GPUSCHED_SIMULATE_GPUS": "2"},
)

RECORDING_TEST = """
    import json, os, subprocess, time
    import pytest

    {marker}
    def test_record():
        start = time.time()
        tag = os.environ["GPUSCHED_JOB_TAG"]
        if {escapee}:  # a process that leaves the file's process group, as Ray workers do
            subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(os.path.join({marks!r}, tag + ".start"), "w") as out:
            out.write(os.path.basename(__file__))
        time.sleep({sleep})
        with open({log!r}, "a") as out:
            out.write(json.dumps({{
                "file": os.path.basename(__file__), "cards": os.environ["CUDA_VISIBLE_DEVICES"],
                "tag": tag, "start": start, "end": time.time(),
            }}) + "\\n")
"""


@contextlib.contextmanager
def ray_cluster(nodes: Sequence[Mapping[str, str]]) -> Iterator:
    """A running cluster with one raylet per entry of ``nodes`` (its environment); the first is the head."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        for name, value in RAY_ENV.items():
            patch.setenv(name, value)
        patch.delenv("RAY_ADDRESS", raising=False)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "env_vars": dict(nodes[0]),
                "_system_config": FAST_HEALTH,
            },
        )
        try:
            for env in nodes[1:]:
                cluster.add_node(num_cpus=1, env_vars=dict(env))
            cluster.wait_for_nodes()
            yield cluster
        finally:
            for node in list(cluster.worker_nodes):
                remove_node(cluster, node)
            if cluster.head_node is not None:
                remove_node(cluster, cluster.head_node)


def node_processes(node) -> list:
    """A raylet's processes and their children (its dashboard and runtime-env agents)."""
    import psutil

    family = []
    for info in node.all_processes.values():
        for process_info in info:
            try:
                parent = psutil.Process(process_info.process.pid)
                family += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return family


def kill_processes(processes: Sequence) -> None:
    import psutil

    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def remove_node(cluster, node, family: Sequence = ()) -> None:
    """Kill a raylet and what it started: its agents outlive a killed raylet by minutes."""
    family = [*family, *node_processes(node)]
    cluster.remove_node(node, allow_graceful=False)
    kill_processes(family)


@pytest.fixture(scope="module")
def cluster_shared():
    """2 nodes x 4 simulated cards and 1 node x 2, shared by a module's tests (start-up costs seconds)."""
    with ray_cluster(SHAPE) as cluster:
        yield cluster


@contextlib.contextmanager
def extra_node(cluster, env: Mapping[str, str]) -> Iterator:
    """One more node in ``cluster`` for the block; removed (killed) at its end if still there."""
    node = cluster.add_node(num_cpus=1, env_vars=dict(env))
    cluster.wait_for_nodes()
    family = node_processes(node)  # a test may kill the raylet: its agents are found now
    try:
        yield node
    finally:
        if node in cluster.worker_nodes:
            remove_node(cluster, node, family)
        else:
            kill_processes(family)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "CUDA_VISIBLE"))}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_ENV)
    return env


def write_suite(root: Path, files: Mapping[str, str]) -> None:
    for name, source in files.items():
        (root / name).write_text(textwrap.dedent(source))


def recording_file(root: Path, gpus: int, sleep: float, escapee: bool = False) -> str:
    marks = root / "marks"
    marks.mkdir(exist_ok=True)
    return RECORDING_TEST.format(
        marker=f"@pytest.mark.gpu({gpus})" if gpus else "",
        sleep=sleep,
        log=str(root / "record.jsonl"),
        marks=str(marks),
        escapee=escapee,
    )


def records(root: Path) -> list[dict]:
    path = root / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def started(root: Path) -> dict[str, str]:
    """Job tag -> file, for every file whose test has begun."""
    marks = root / "marks"
    return {p.name.removesuffix(".start"): p.read_text() for p in marks.glob("*.start")}


def run_processes(run_id: str) -> list[psutil.Process]:
    """Live processes of a gpusched run: its job tags (and fork servers') start with the run id."""
    found = []
    for proc in psutil.process_iter():
        try:
            tag = proc.environ().get("GPUSCHED_JOB_TAG", "")
            if (
                tag.startswith((f"{run_id}-", f"fs-{run_id}-"))
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def gpusched(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real ``gpusched`` command in ``root``."""
    return subprocess.run(
        [sys.executable, "-m", "gpusched", *args],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=hang_guard(timeout),
    )


def start_gpusched(root: Path, *args: str) -> subprocess.Popen:
    out = open(root / "gpusched.out", "w")  # noqa: SIM115 - the process writes it; closed by GC
    return subprocess.Popen(
        [sys.executable, "-m", "gpusched", *args],
        cwd=root,
        env=clean_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
