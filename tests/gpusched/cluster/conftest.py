"""Real multi-node Ray clusters on this machine, for ``gpusched run --ray``.

Each node is its own raylet and declares its own simulated cards with
``GPUSCHED_SIMULATE_GPUS`` in its environment, as a node of a real cluster
would in the environment of its ``ray start``. Nodes have one CPU each: a CPU
slot per node, and little load on a small machine. Two ways to start them:
``ray_cluster`` (``ray.cluster_utils.Cluster``, token authentication off: nodes
are added and killed mid-test) and ``started_cluster`` (the ``ray start``
commands users type, with token authentication on).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

from gpusched.execution.childenv import PortPool
from gpusched.execution.proctree import processes_where
from rl_e2e.ray_job import RAY_START
from rl_e2e.ray_local import with_lazy_workers
from rl_e2e.ray_startup import (
    ATTEMPTS,
    NODE_START_TIMEOUT,
    patient_node_start,
)
from rl_e2e.reaper import kill_and_wait

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
        release = {release!r}  # None, or a file whose creation ends this test (2 min at most)
        while release and not os.path.exists(release) and time.time() < start + 120:
            time.sleep(0.05)
        with open({log!r}, "a") as out:
            out.write(json.dumps({{
                "file": os.path.basename(__file__), "cards": os.environ["CUDA_VISIBLE_DEVICES"],
                "tag": tag, "start": start, "end": time.time(),
            }}) + "\\n")
"""


@contextlib.contextmanager
def ray_cluster(nodes: Sequence[Mapping[str, str]]) -> Iterator:
    """A running cluster with one raylet per entry of ``nodes`` (its environment); the first is the head.

    Its sessions and the address file ``cluster_utils`` writes (``ray.init()``
    would connect to that address after the test) go to a temp dir of its own
    (``RAY_TMPDIR``, in ``/tmp``: Ray's socket paths must stay under 107 bytes),
    removed at the end: under plain pytest they would otherwise land in
    ``/tmp/ray``, the file naming a dead cluster.
    """
    from ray.cluster_utils import Cluster

    with (
        tempfile.TemporaryDirectory(
            prefix="gsc", dir="/tmp", ignore_cleanup_errors=True
        ) as temp_dir,
        pytest.MonkeyPatch.context() as patch,
    ):
        for name, value in {**RAY_ENV, "RAY_TMPDIR": temp_dir}.items():
            patch.setenv(name, value)
        patch.delenv("RAY_ADDRESS", raising=False)
        with patient_node_start():
            cluster = Cluster(
                initialize_head=True,
                # No idle workers started ahead for a driver: gpusched's node agents are actors
                # with workers of their own (with_lazy_workers, as rl_e2e's clusters).
                head_node_args=with_lazy_workers(
                    {
                        "num_cpus": 1,
                        "num_gpus": 0,  # see _ray_args: Ray counts no card, the node simulates its own
                        "include_dashboard": False,
                        "env_vars": dict(nodes[0]),
                        # A new dict: Ray writes this cluster's spilling directory into it, and the
                        # next cluster would spill into (and create again) this one's, gone by then.
                        "_system_config": dict(FAST_HEALTH),
                    }
                ),
            )
        try:
            with patient_node_start():
                for env in nodes[1:]:
                    cluster.add_node(num_cpus=1, num_gpus=0, env_vars=dict(env))
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


def remove_node(cluster, node, family: Sequence = ()) -> None:
    """Kill a raylet and what it started: its agents outlive a killed raylet by minutes."""
    family = [*family, *node_processes(node)]
    cluster.remove_node(node, allow_graceful=False)
    kill_and_wait(family)


@pytest.fixture(scope="module")
def cluster_shared():
    """2 nodes x 4 simulated cards and 1 node x 2, shared by a module's tests (start-up costs seconds)."""
    with ray_cluster(SHAPE) as cluster:
        yield cluster


@contextlib.contextmanager
def extra_node(cluster, env: Mapping[str, str]) -> Iterator:
    """One more node in ``cluster`` for the block; removed (killed) at its end if still there."""
    with patient_node_start():
        node = cluster.add_node(num_cpus=1, num_gpus=0, env_vars=dict(env))
    cluster.wait_for_nodes()
    family = node_processes(node)  # a test may kill the raylet: its agents are found now
    try:
        yield node
    finally:
        if node in cluster.worker_nodes:
            remove_node(cluster, node, family)
        else:
            kill_and_wait(family)


def clean_env(ray_env: Mapping[str, str] = RAY_ENV) -> dict[str, str]:
    """This environment without gpusched's, CUDA's, coverage's, Ray's address and token
    variables, plus ``ray_env``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSCHED_", "CUDA_VISIBLE", "RAY_AUTH_", "COVERAGE_"))
        and k != "RAY_ADDRESS"
    }
    env.pop("PYTEST_ADDOPTS", None)
    env.update(ray_env)
    return env


# ---------------------------------------------------------------- clusters as users start them

MARK_VARIABLE = "GPUSCHED_TEST_CLUSTER"  # in every process a `ray start` below starts
# Ray runs its workers at nice 15 (a trainer's workers, gpusched's agents and the files they
# start), for a machine of the cluster's own. Here they share the cores with other test
# files at nice 0 in the same session (one autogroup under gpusched) and wait behind them:
# beside two busy processes a two-step trainer run took 104-195 s at 15, 29-32 s at 0.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


@dataclass
class StartedCluster:
    """A cluster started with the ``ray start`` command, as users start one.

    ``home`` is the HOME of every process of it, so the token Ray generated is
    in ``home/.ray/auth_token``: the driver finds it there as Ray's clients do
    in ``~/.ray/auth_token``. Every process it started carries ``MARK_VARIABLE``
    = ``home`` (``processes``).
    """

    address: str
    home: Path
    token: str | None
    nodes: int = 0  # raylets started so far

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a command run "on a machine of the cluster's user"."""
        return {**clean_env({"RAY_USAGE_STATS_ENABLED": "0"}), "HOME": str(self.home), **extra}

    def processes(self) -> list[psutil.Process]:
        return processes_where(MARK_VARIABLE, lambda value: value == str(self.home))

    def node_env(self, node: Mapping[str, str]) -> dict[str, str]:
        """What a ``ray start`` of ``node`` runs in: marked, workers at nice 0, its own variables."""
        env = {**self.env(), MARK_VARIABLE: str(self.home), **WORKER_NICENESS, **_node_env(node)}
        if self.token is None:
            env["RAY_AUTH_MODE"] = "disabled"
        return env

    def start_join(self, node: Mapping[str, str]) -> subprocess.Popen:
        """``ray start --address`` for one more raylet with ``node``'s variables and flags (it
        returns once the raylet runs); with token authentication, ``RAY_AUTH_MODE=token``."""
        env = self.node_env(node)
        if self.token is not None:
            env["RAY_AUTH_MODE"] = "token"
        self.nodes += 1
        return subprocess.Popen(
            [*RAY_START, "--address", self.address,
             "--num-cpus", "1", "--temp-dir", str(self.home / f"n{self.nodes}"),
             *_node_ports(), *_ray_args(node)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip

    def join(self, node: Mapping[str, str]) -> None:
        """One more raylet; started again (new ports, the attempt's processes killed) where
        ``ray start`` missed Ray's own deadline for the node to register (a busy machine)."""
        for attempt in range(1, ATTEMPTS + 1):
            before = set(self.processes())
            process = self.start_join(node)
            out, _ = process.communicate(timeout=hang_guard(120))
            if process.returncode == 0:
                return
            if NODE_START_TIMEOUT not in out or attempt == ATTEMPTS:
                raise AssertionError(out)
            stop_processes([proc for proc in self.processes() if proc not in before])


_PORTS = PortPool()


def free_port() -> int:
    """A port nothing listens on now, outside the kernel's ephemeral range, never
    handed out before by this process (gpusched's own pool of ports).

    ``bind(0)`` and every ``connect()`` on the machine draw from
    ``ip_local_port_range``: a port probed there and released was taken by
    another test file's Ray cluster before this ``ray start`` bound it (its GCS
    then failed with "Address already in use", and the CLI, reaching the other
    cluster's GCS, with "InvalidAuthToken"). Two servers of one ``ray start``
    given the same port make Ray refuse to start.
    """
    return _PORTS.take()


def _node_ports() -> list[str]:
    """Ports of their own for each raylet's servers: several raylets share this machine."""
    names = (
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    )
    return [item for name in names for item in (name, str(free_port()))]


def _ray_start(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """``ray start``: None if it started, its output if it missed Ray's own deadline for the
    node to register (a busy machine: the caller stops what it left and starts again)."""
    result = subprocess.run(
        [*RAY_START, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=hang_guard(120),
    )
    out = result.stdout + result.stderr
    if result.returncode != 0 and NODE_START_TIMEOUT in out:
        return out
    assert result.returncode == 0, out
    return None


def stop_processes(processes: Sequence[psutil.Process]) -> None:
    """KILL these processes and what they started, all at once.

    No SIGTERM first: the cluster and its files are thrown away, and Ray's
    graceful stop is no part of what the tests check. Sent to a whole cluster
    at once, SIGTERM left the GCS and the autoscaler monitor running for more
    than 30 s here (``ray stop`` avoids that by stopping raylets, then the
    rest, then the GCS, which still took 5 s on a loaded machine), so a grace
    period only put off the KILL.
    """
    family: dict[int, psutil.Process] = {}
    for proc in processes:
        try:
            family.update({p.pid: p for p in (proc, *proc.children(recursive=True))})
        except psutil.Error:
            pass
    kill_and_wait(list(family.values()))


@contextlib.contextmanager
def started_cluster(nodes: Sequence[Mapping[str, str]], token: bool = True) -> Iterator:
    """``ray start --head`` with the first of ``nodes`` (its extra environment), ``ray start
    --address`` with each other; stopped (its processes killed) at the end.

    With ``token``, as the docs say: ``ray get-auth-token --generate`` first, so
    the head starts with token authentication (Ray's default when a token
    exists) and the other nodes join with ``RAY_AUTH_MODE=token``. A short
    directory of its own (Ray's socket paths must stay under 107 bytes) is
    HOME and Ray's temp dir; nothing of it outlives the block.
    """
    home = Path(tempfile.mkdtemp(prefix="gsr", dir="/tmp"))
    cluster = StartedCluster("", home, None)
    try:
        if token:
            _ray_generate_token(cluster.env())
            cluster.token = (home / ".ray" / "auth_token").read_text().strip()
        for attempt in range(1, ATTEMPTS + 1):
            port = free_port()
            cluster.address = f"127.0.0.1:{port}"
            missed = _ray_start(
                ["--head", "--port", str(port), "--num-cpus", "1", "--temp-dir",
                 str(home / f"h{attempt}"), "--include-dashboard", "false",
                 "--ray-client-server-port", str(free_port()), *_node_ports(),
                 *_ray_args(nodes[0])],
                cluster.node_env(nodes[0]),
            )  # fmt: skip
            if missed is None:
                break
            assert attempt < ATTEMPTS, missed
            stop_processes(cluster.processes())  # the head that came too late: start anew
        for node in nodes[1:]:
            cluster.join(node)
        yield cluster
    finally:
        stop_processes(cluster.processes())
        left = cluster.processes()
        shutil.rmtree(home, ignore_errors=True)
        assert not left, [(p.pid, p.name()) for p in left]


def _ray_generate_token(env: Mapping[str, str]) -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )
    assert result.returncode == 0, result.stderr


def _node_env(node: Mapping[str, str]) -> dict[str, str]:
    """A node's environment variables (``GPUSCHED_SIMULATE_GPUS``...), without the ``ray start`` flags."""
    return {k: v for k, v in node.items() if not k.startswith("--")}


def _ray_args(node: Mapping[str, str]) -> list[str]:
    """A node's own ``ray start`` flags (``{"--num-gpus": "2"}``); ``--num-gpus 0`` unless given.

    Without the flag Ray counts the machine's real cards: on a GPU machine every
    simulated node would then report them, and a run would hold only those
    (``held_cards``). With 0 the nodes are the same on every machine.
    """
    flags = {"--num-gpus": "0", **{k: v for k, v in node.items() if k.startswith("--")}}
    return [item for k, v in flags.items() for item in (k, v)]


def write_suite(root: Path, files: Mapping[str, str]) -> None:
    for name, source in files.items():
        (root / name).write_text(textwrap.dedent(source))


def recording_file(
    root: Path, gpus: int, sleep: float, escapee: bool = False, release: Path | None = None
) -> str:
    """A test file that records its cards and times; it lasts ``sleep`` seconds, then, with
    ``release``, until that file exists (the test creates it when the file may end)."""
    marks = root / "marks"
    marks.mkdir(exist_ok=True)
    return RECORDING_TEST.format(
        marker=f"@pytest.mark.gpu({gpus})" if gpus else "",
        sleep=sleep,
        release=str(release) if release is not None else None,
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


def gpusched(
    root: Path, *args: str, timeout: float = 120, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real ``gpusched`` command in ``root`` (in ``env``, by default ``clean_env()``)."""
    return subprocess.run(
        [sys.executable, "-m", "gpusched", *args],
        cwd=root,
        env=dict(env) if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=hang_guard(timeout),
    )


def start_gpusched(
    root: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    out = open(root / "gpusched.out", "w")  # noqa: SIM115 - the process writes it; closed by GC
    return subprocess.Popen(
        [sys.executable, "-m", "gpusched", *args],
        cwd=root,
        env=dict(env) if env is not None else clean_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
