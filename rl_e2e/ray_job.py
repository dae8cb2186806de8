"""A Ray cluster started as users start theirs (``ray start --head``), for ``ray job submit``.

The production path of an RL repository is often ``ray job submit
--runtime-env-json ... -- python -m my_trainer``: the job's runtime env is the
third layer over the repository's defaults and forwarded host variables. To
test that path for real, :func:`head_cluster` runs ``ray start --head --block``
on loopback with token authentication on (Ray's default), a token of its own
(``RAY_AUTH_TOKEN``, so neither ``~/.ray/auth_token`` nor another cluster's
token is used or changed), its own ports and a private temp dir, and
:meth:`JobCluster.submit` submits a command to it.

It is stopped whatever happens, never with ``ray stop`` (which stops every Ray
cluster on the machine): the blocking ``ray start`` gets SIGTERM and stops what
it started; then anything left of its process tree, and any process still
naming its temp dir, is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_e2e.ray_local import short_temp_root

__all__ = ["JobCluster", "JobClusterError", "head_cluster"]

RAY = str(Path(sys.executable).with_name("ray"))

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


class JobClusterError(RuntimeError):
    """The head did not come up; the message carries the end of its log."""


@dataclass
class JobCluster:
    """A running ``ray start --head`` cluster: its job-submission URL and how to reach it."""

    url: str
    temp_dir: Path
    log: Path
    env: dict[str, str] = field(repr=False)
    tree: list[Any] = field(default_factory=list, repr=False)

    def submit(
        self,
        entrypoint: Sequence[str],
        runtime_env: Mapping[str, Any] | None = None,
        timeout_s: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        """``ray job submit --runtime-env-json ... -- ENTRYPOINT``; wait for the job's end.

        Retried while the job agent has not registered yet. The result carries
        the job's output (``ray job submit`` follows its logs).
        """
        command = [RAY, "job", "submit", "--address", self.url]
        if runtime_env is not None:
            command += ["--runtime-env-json", json.dumps(dict(runtime_env))]
        command += ["--", *entrypoint]
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 1)
            done = subprocess.run(
                command, env=self.env, capture_output=True, text=True, timeout=left
            )
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
                return done
            time.sleep(1)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports (all held open at once, then released)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def cluster_env(token: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the cluster's processes and of its clients.

    Token auth on with this cluster's own token; ``RAY_ADDRESS`` removed (never
    set to "": Ray treats "" as an address).
    """
    env = {**(os.environ if base is None else base)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
    return env


def _wait_for_dashboard(
    url: str, token: str, head: subprocess.Popen, log: Path, timeout_s: float
) -> None:
    """Until the dashboard answers an authenticated request (the job API lives there)."""
    request = urllib.request.Request(
        f"{url}/api/version", headers={"Authorization": f"Bearer {token}"}
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise JobClusterError(
                f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(request, timeout=1):
                return
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise JobClusterError(
                    f"the dashboard at {url} refused this cluster's own token ({err})"
                ) from None
            time.sleep(0.5)
        except OSError:
            time.sleep(0.5)
    raise JobClusterError(
        f"Ray dashboard at {url} not up after {timeout_s:g} s:\n{log.read_text()[-3000:]}"
    )


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _naming(text: str) -> list[Any]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


def _stop(head: subprocess.Popen, tree: list[Any], temp_dir: Path, grace_s: float) -> None:
    """SIGTERM the blocking ``ray start`` (it stops what it started), then kill leftovers."""
    import psutil

    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    _, alive = psutil.wait_procs(tree, timeout=grace_s / 4)
    alive += [p for p in _naming(str(temp_dir)) if p not in alive]
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@contextmanager
def head_cluster(
    log: Path,
    num_cpus: int = 2,
    start_timeout_s: float = 450,
    stop_grace_s: float = 200,
    extra_args: Sequence[str] = (),
) -> Iterator[JobCluster]:
    """Run ``ray start --head --block`` on loopback; yield it; always stop it.

    Raises:
        JobClusterError: ``ray start`` exited, or its dashboard did not answer
            within ``start_timeout_s``; the message ends with its log.
    """
    ports = dict(zip(_PORT_OPTIONS, _free_ports(len(_PORT_OPTIONS)), strict=True))
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir=short_temp_root()))
    token = secrets.token_hex(32)
    env = cluster_env(token)
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *(f"{option}={port}" for option, port in ports.items()),
        *extra_args,
    ]
    cluster = JobCluster(
        url=f"http://127.0.0.1:{ports['--dashboard-port']}", temp_dir=temp_dir, log=log, env=env
    )
    try:
        with log.open("w") as out:
            head = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
            )
        try:
            _wait_for_dashboard(cluster.url, token, head, log, start_timeout_s)
            yield cluster
        finally:
            # Workers leave the process group, but stay in the process tree.
            cluster.tree = _tree(head.pid)
            _stop(head, cluster.tree, temp_dir, stop_grace_s)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
