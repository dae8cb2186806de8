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
naming its temp dir, is killed. Its ports are chosen where no other process
on the machine is handed one (:func:`quiet_ports`), and a start that dies
on a missed Ray start-up deadline is tried again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_e2e.coverage import WorkerCoverage, start_measuring
from rl_e2e.ports import quiet_ports
from rl_e2e.ray_local import short_temp_root

__all__ = ["JobCluster", "JobClusterError", "head_cluster"]

RAY = str(Path(sys.executable).with_name("ray"))
# `ray start` with more than Ray's fixed 30 s for the node to register (a busy machine).
RAY_START = [sys.executable, "-m", "rl_e2e.patient_ray", "start"]

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
    #: ``TMPDIR`` of the cluster's processes and of the jobs they run; removed with the cluster.
    tmp: Path
    env: dict[str, str] = field(repr=False)
    tree: list[Any] = field(default_factory=list, repr=False)
    coverage: WorkerCoverage | None = field(default=None, repr=False)

    def submit(
        self,
        entrypoint: Sequence[str],
        runtime_env: Mapping[str, Any] | None = None,
        timeout_s: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        """``ray job submit --runtime-env-json ... -- ENTRYPOINT``; wait for the job's end.

        The job gets a submission id of its own, so a request the job server
        dropped (a reset connection on a loaded machine) is sent again without
        running the job twice; the same for "No available agent" right after
        start-up. The result's ``returncode`` is 0 when the job succeeded, its
        ``stdout`` the job's logs and final status.

        While coverage measures this process, the job's runtime env also
        carries coverage's start-up variable: its driver and workers are
        measured, and merged when the cluster stops (:mod:`rl_e2e.coverage`).
        """
        if self.coverage is not None:
            runtime_env = self.coverage.runtime_env(runtime_env)
        submission_id = f"e2e-{secrets.token_hex(6)}"
        command = ["job", "submit", "--address", self.url, "--submission-id", submission_id]
        if runtime_env is not None:
            command += ["--runtime-env-json", json.dumps(dict(runtime_env))]
        command += ["--no-wait", "--", *entrypoint]
        deadline = time.monotonic() + timeout_s
        sent = self._ray(command, deadline, accept=("already exists",))
        if sent.returncode != 0 and "already exists" not in sent.stdout + sent.stderr:
            return sent
        status = ""
        while time.monotonic() < deadline:
            status = self._status(submission_id) or status
            if status in FINAL_STATUSES:
                break
            time.sleep(1)
        logs = self._ray(["job", "logs", "--address", self.url, submission_id], deadline)
        return subprocess.CompletedProcess(
            [RAY, *command],
            0 if status == "SUCCEEDED" else 1,
            stdout=f"{logs.stdout}\njob {submission_id}: {status or 'no status before the deadline'}\n",
            stderr=sent.stderr + logs.stderr,
        )

    def _status(self, submission_id: str) -> str | None:
        """The job's status as its job server's REST API gives it (what ``ray job status``
        asks for); None while the server does not answer.

        Asked over HTTP, not with the ``ray`` CLI: each CLI call is a Python process
        importing Ray, 1-2 core-seconds, and a job is polled every second.
        """
        request = _authorized(f"{self.url}/api/jobs/{submission_id}", self.env["RAY_AUTH_TOKEN"])
        try:
            with urllib.request.urlopen(request, timeout=STATUS_TIMEOUT_S) as reply:
                return job_status(reply.read())
        except OSError:  # not up yet, or a request dropped under load: asked again
            return None

    def _ray(
        self, args: Sequence[str], deadline: float, accept: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        """One ``ray`` CLI call, sent again while the server is not ready or dropped it."""
        while True:
            left = max(deadline - time.monotonic(), 1)
            done = subprocess.run(
                [RAY, *args], env=self.env, capture_output=True, text=True, timeout=left
            )
            text = done.stdout + done.stderr
            transient = (
                done.returncode != 0
                and any(sign in text for sign in _TRANSIENT)
                and not any(sign in text for sign in accept)
            )
            if not transient or time.monotonic() > deadline:
                return done
            time.sleep(1)


# A job's statuses after which it runs no more (Ray's JobStatus).
FINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# Seconds to wait for the job server's answer to one status request.
STATUS_TIMEOUT_S = 10

# What a job server still starting up, or dropping a request under load, answers.
_TRANSIENT = (
    "No available agent",
    "RemoteDisconnected",
    "Connection aborted",
    "ConnectionError",
    "Connection refused",
    "Failed to connect",
)


def job_status(reply: bytes | str) -> str | None:
    """The status in the job server's answer to ``GET /api/jobs/ID``: ``PENDING``,
    ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED``; None if the answer holds none."""
    try:
        details = json.loads(reply)
    except ValueError:
        return None
    status = details.get("status") if isinstance(details, dict) else None
    return status if status in (*FINAL_STATUSES, "PENDING", "RUNNING") else None


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


def _authorized(url: str, token: str) -> urllib.request.Request:
    """A GET of ``url`` on the cluster's dashboard, with its token."""
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})


def _wait_until_up(
    url: str, token: str, head: subprocess.Popen, log: Path, since: int, timeout_s: float
) -> bool:
    """True once ``ray start`` blocks (its node registered) and the dashboard answers.

    False when ``ray start`` exited while starting: Ray's start-up deadlines (the
    raylet waits 15 s for its dashboard agent, ``ray start`` 30 s for the raylet)
    can pass on a loaded machine.

    Raises:
        JobClusterError: not up within ``timeout_s``, or the dashboard refuses the token.
    """
    request = _authorized(f"{url}/api/version", token)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            return False
        if "will now block forever" in log.read_text(errors="replace")[since:]:
            try:
                with urllib.request.urlopen(request, timeout=1):
                    pass
            except urllib.error.HTTPError as err:
                if err.code in (401, 403):
                    raise JobClusterError(
                        f"the dashboard at {url} refused this cluster's own token ({err})"
                    ) from None
            except OSError:
                pass
            else:
                time.sleep(2)  # a process that missed a deadline just before exits now
                if head.poll() is None:
                    return True
        time.sleep(0.5)
    raise JobClusterError(
        f"Ray at {url} not up after {timeout_s:g} s:\n{log.read_text(errors='replace')[-3000:]}"
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
    attempts: int = 3,
) -> Iterator[JobCluster]:
    """Run ``ray start --head --block`` on loopback; yield it; always stop it.

    Started again, on new ports and in a new temp dir, when it exits while
    starting (a start-up deadline missed on a loaded machine), ``attempts``
    times at most; every attempt is logged to ``log``.

    Raises:
        JobClusterError: no attempt came up; the message ends with the log.
    """
    root = Path(tempfile.mkdtemp(prefix="rj", dir=short_temp_root()))
    cluster: JobCluster | None = None
    token = secrets.token_hex(32)
    # The cluster's processes (jobs included) and its clients make their temporary files
    # in here, removed below with the rest: the stop kills processes that would remove
    # theirs at exit.
    tmp = root / "tmp"
    tmp.mkdir()
    env = {**cluster_env(token), "TMPDIR": str(tmp)}
    log.touch()
    try:
        for attempt in range(1, attempts + 1):
            ports = dict(zip(_PORT_OPTIONS, quiet_ports(len(_PORT_OPTIONS)), strict=True))
            temp_dir = root / str(attempt)
            temp_dir.mkdir()
            command = [
                *RAY_START,
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
            url = f"http://127.0.0.1:{ports['--dashboard-port']}"
            since = log.stat().st_size
            with log.open("a") as out:
                out.write(f"--- attempt {attempt}: {' '.join(command)}\n")
                out.flush()
                head = subprocess.Popen(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
                )
            try:
                up = _wait_until_up(url, token, head, log, since, start_timeout_s)
            except BaseException:
                _stop(head, _tree(head.pid), temp_dir, stop_grace_s)
                raise
            if up:
                break
            _stop(head, _tree(head.pid), temp_dir, stop_grace_s)
        else:
            raise JobClusterError(
                f"ray start exited while starting, {attempts} times:\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        cluster = JobCluster(url=url, temp_dir=temp_dir, log=log, tmp=tmp, env=env)
        cluster.coverage = start_measuring()
        try:
            yield cluster
        finally:
            try:
                if cluster.coverage is not None:
                    cluster.coverage.save()
            finally:
                # Workers leave the process group, but stay in the process tree.
                cluster.tree = _tree(head.pid)
                _stop(head, cluster.tree, temp_dir, stop_grace_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if cluster is not None and cluster.coverage is not None:
            cluster.coverage.merge()
