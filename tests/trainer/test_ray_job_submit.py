"""A real ``ray job submit``: the job's runtime env wins over the trainer's, without conflicts.

``ray start --head`` with bounded CPUs, a private temp dir and its own ports
(so it can run beside other Ray clusters on the machine), then a small driver
submitted with ``--runtime-env-json`` setting ``NCCL_DEBUG=INFO`` (our default
is ``WARN``) and a ``working_dir``. The driver calls
``ray.init(runtime_env=get_runtime_env())``: without the layering Ray would
refuse the merge; with it the job succeeds and its workers see ``INFO``.
Then ``python -m trainer`` itself is submitted: it must join the cluster it
was submitted to (Ray gives the job ``RAY_ADDRESS``) and train a step there.

The cluster is stopped whatever happens. Not with ``ray stop``: that stops
*every* Ray process on the machine, including clusters of tests running in
parallel. Instead the blocking ``ray start`` gets SIGTERM (it drains and stops
the processes it started) and anything left of its process tree is killed; the
test then checks that nothing of the cluster remains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

RAY = str(Path(sys.executable).with_name("ray"))
pytestmark = pytest.mark.timeout(hang_guard(300))

_PORT_OPTIONS = (
    "--port",
    "--dashboard-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
)

REPO = Path(__file__).resolve().parents[2]

#: The smallest ``python -m trainer`` run: one step of 2 prompts x 2 responses.
TINY_RUN = [
    "algo=grpo",
    "trainer.total_steps=1",
    "trainer.val_every=0",
    "trainer.progress=false",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "data.num_train_examples=8",
    "data.num_val_examples=2",
]

DRIVER = """
import json, os
import ray
from trainer.runtime_env import get_runtime_env

ray.init(runtime_env=get_runtime_env())

@ray.remote(num_cpus=1)
def look():
    return {
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
        "marker_in_cwd": os.path.exists("marker.txt"),
        "pid": os.getpid(),
    }

results = ray.get([look.remote() for _ in range(2)])
print("RESULT " + json.dumps(results), flush=True)
"""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports (all held open at once, then released)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _ray_env() -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # never "": Ray would treat it as an address
    return env


def _wait_for_dashboard(url: str, head: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"Ray dashboard at {url} not up after {timeout_s}s:\n{log.read_text()[-3000:]}")


def _stop(head: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """SIGTERM the blocking ``ray start`` (it stops what it started), then kill leftovers."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=hang_guard(40))
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    _, alive = psutil.wait_procs(tree, timeout=hang_guard(10))
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@dataclass
class RayHead:
    """The job-submission address, and after stopping, the processes the cluster had."""

    url: str
    tree: list[psutil.Process] = field(default_factory=list)


@contextmanager
def _ray_head(temp_dir: Path, log: Path) -> Iterator[RayHead]:
    """Run ``ray start --head --block`` on loopback; yield its address; always stop it."""
    ports = dict(zip(_PORT_OPTIONS, _free_ports(len(_PORT_OPTIONS)), strict=True))
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=2",
        "--num-gpus=0",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *(f"{option}={port}" for option, port in ports.items()),
    ]
    cluster = RayHead(url=f"http://127.0.0.1:{ports['--dashboard-port']}")
    with log.open("w") as out:
        head = subprocess.Popen(
            command, env=_ray_env(), stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
    try:
        _wait_for_dashboard(cluster.url, head, log, timeout_s=hang_guard(90))
        yield cluster
    finally:
        # Workers leave the process group, but stay in the process tree.
        cluster.tree = _tree(head.pid)
        _stop(head, cluster.tree)


def _submit(
    url: str, runtime_env: dict, entrypoint: list[str], timeout_s: float
) -> subprocess.CompletedProcess:
    """``ray job submit``, retried while the job agent has not registered yet."""
    command = [
        RAY,
        "job",
        "submit",
        "--address",
        url,
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        *entrypoint,
    ]
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(deadline - time.monotonic(), 1)
        done = subprocess.run(command, env=_ray_env(), capture_output=True, text=True, timeout=left)
        if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(1)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if text in cmdline:
            found.append(f"{proc.pid}: {cmdline[:150]}")
    return found


def test_ray_job_submit_runtime_env_wins_and_cluster_is_stopped(tmp_path):
    working_dir = tmp_path / "job"
    working_dir.mkdir()
    (working_dir / "driver.py").write_text(textwrap.dedent(DRIVER))
    (working_dir / "marker.txt").write_text("shipped with working_dir\n")
    # Ray's socket paths must stay short: not under pytest's tmp_path.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    try:
        with _ray_head(temp_dir, tmp_path / "head.log") as cluster:
            runtime_env = {"env_vars": {"NCCL_DEBUG": "INFO"}, "working_dir": str(working_dir)}
            done = _submit(cluster.url, runtime_env, [sys.executable, "driver.py"], hang_guard(180))
            # The trainer itself as a job: it joins the cluster (Ray sets RAY_ADDRESS).
            trainer_env = {
                "env_vars": {"PYTHONPATH": str(REPO), "TRAINER_CACHE": str(tmp_path / "cache")}
            }
            trained = _submit(
                cluster.url,
                trainer_env,
                [sys.executable, "-m", "trainer", *TINY_RUN, f"trainer.run_dir={tmp_path / 'run'}"],
                hang_guard(180),
            )
        assert len(cluster.tree) >= 3, "expected gcs, raylet, dashboard, ... in the tree"
        assert [p.pid for p in cluster.tree if p.is_running()] == []
        assert _processes_mentioning(str(temp_dir)) == []
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-5000:]
        (line,) = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
        results = json.loads(line.removeprefix("RESULT "))
        assert len(results) == 2
        for seen in results:
            assert seen["NCCL_DEBUG"] == "INFO"  # the job's value, not our WARN
            assert seen["TOKENIZERS_PARALLELISM"] == "true"  # our default still applies
            assert seen["marker_in_cwd"] is True  # the job's working_dir
        assert trained.returncode == 0, (trained.stdout + trained.stderr)[-5000:]
        assert "trainer: done: 1 steps" in trained.stdout
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
