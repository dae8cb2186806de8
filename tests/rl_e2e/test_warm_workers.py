"""Warm worker start (``rl_e2e.warm_workers``): workers forked from a warm process, for real.

The shim and the warm process are run as Ray runs them (``python -S
worker_shim.py SCRIPT ARGS`` in the worker's environment), on small scripts
in place of Ray's ``default_worker.py``, with a sleeping process standing for
the raylet; then Ray actors on this repository's runtime env, which turns warm
start on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from rl_e2e.warm_workers import SHIM, warm_runtime_env
from rl_e2e.worker_shim import PRELOAD_VARIABLE, RAYLET_VARIABLE, zygote_key

REPORT = """\
import json, os, random, sys
import numpy
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "marker": "warmmarker" in sys.modules,
    "random": random.random(), "numpy": numpy.random.random(), "argv": sys.argv, "cwd": os.getcwd(),
    "job": os.environ.get("RAY_JOB_ID"), "set": os.environ.get("WARMMARKER_SET"),
    "fds": len(os.listdir("/proc/self/fd")),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""

SLEEP = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # as Ray's worker ends cleanly on SIGTERM
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.fixture
def node(tmp_path: Path):
    """A directory with the scripts and a marker module, and a process standing for the raylet."""
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "sleep.py").write_text(SLEEP)
    lib = tmp_path / "lib"
    lib.mkdir()
    imports = tmp_path / "imports.log"
    (lib / "warmmarker.py").write_text(
        f"import os\nopen({str(imports)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "os.environ['WARMMARKER_SET'] = 'at import'\n"  # as torch sets TORCHINDUCTOR_CACHE_DIR
    )
    raylet = subprocess.Popen(["sleep", "600"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    env.update(
        {
            PRELOAD_VARIABLE: "warmmarker,numpy",
            RAYLET_VARIABLE: str(raylet.pid),
            "PYTHONPATH": str(lib),
        }
    )
    yield tmp_path, env, raylet, imports
    raylet.kill()
    raylet.wait()
    _gone(_zygotes(env))


def _shim(*argv: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", str(SHIM), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _starter(cwd: Path, env: dict[str, str], err: Path) -> tuple[subprocess.Popen, dict]:
    """The first shim of a key: it starts the warm process and stays until that leaves.

    Returns it and what its worker reported; its stderr (the first worker's log) goes to ``err``.
    """
    with err.open("w") as log:
        starter = subprocess.Popen(
            [sys.executable, "-S", str(SHIM), "report.py", "0"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    return starter, json.loads(starter.stdout.readline())


def _zygotes(env: dict[str, str]) -> list[psutil.Process]:
    """The warm processes of ``env``'s key (not their forked workers, which share their command line)."""
    key = zygote_key(env, sys.executable)
    found = {
        proc.pid: proc
        for proc in psutil.process_iter(["cmdline", "ppid"])
        if any(key in part for part in proc.info["cmdline"] or ())
    }
    return [proc for proc in found.values() if proc.info["ppid"] not in found]


def _gone(processes: list[psutil.Process], within_s: float = 10.0) -> None:
    _, alive = psutil.wait_procs(processes, timeout=within_s)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def test_workers_are_forked_from_one_warm_process_that_imported_once(node):
    cwd, env, _, imports = node
    _, first = _starter(cwd, {**env, "RAY_JOB_ID": "00000000"}, cwd / "first.err")
    runs = [
        _shim("report.py", "0", cwd=cwd, env={**env, "RAY_JOB_ID": f"0{i}000000"}) for i in (1, 2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    seen = [first, *(json.loads(run.stdout) for run in runs)]
    (zygote,) = _zygotes(env)
    assert {s["ppid"] for s in seen} == {zygote.pid}
    assert imports.read_text().split() == [str(zygote.pid)]  # imported once, by it
    assert all(s["marker"] for s in seen)  # and every worker finds it imported
    assert all(s["set"] == "at import" for s in seen)  # with what its import set
    assert len({s["random"] for s in seen}) == 3  # each seeded anew, not the fork's copy
    assert len({s["numpy"] for s in seen}) == 3
    assert len({s["fds"] for s in seen}) == 1  # none holds the warm process's other sockets
    assert all(s["pgid"] == s["pid"] for s in seen)  # a group of its own, as Ray gives workers
    assert [s["job"] for s in seen] == ["00000000", "01000000", "02000000"]
    assert all(s["argv"] == ["report.py", "0"] and s["cwd"] == str(cwd) for s in seen)


def test_exit_status_and_output_reach_the_shims_parent(node):
    cwd, env, _, _ = node
    _starter(cwd, env, cwd / "first.err")
    run = _shim("report.py", "3", cwd=cwd, env=env)
    assert run.returncode == 3
    assert json.loads(run.stdout)["ppid"] != os.getpid()  # warm, not exec'd
    assert run.stderr == "to stderr\n"


def _sleeping_worker(cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, psutil.Process]:
    """A shim whose warm worker sleeps (SIGTERM ends it with status 7), and that worker."""
    _starter(cwd, env, cwd / "first.err")
    pid_file = cwd / "worker.pid"
    shim = subprocess.Popen(
        [sys.executable, "-S", str(SHIM), "sleep.py", str(pid_file)], cwd=cwd, env=env
    )
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and shim.poll() is None
        time.sleep(0.05)
    worker = psutil.Process(int(pid_file.read_text()))
    assert worker.ppid() != shim.pid  # forked by the warm process
    return shim, worker


def test_killing_the_shim_kills_its_worker(node):
    cwd, env, _, _ = node
    shim, worker = _sleeping_worker(cwd, env)
    shim.send_signal(signal.SIGKILL)
    shim.wait()
    _gone([worker])


def test_a_sigterm_to_the_shim_reaches_its_worker(node):
    """Ray stops a worker with SIGTERM, which the worker handles: the shim passes it on."""
    cwd, env, _, _ = node
    shim, _ = _sleeping_worker(cwd, env)
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=60) == 7  # the worker's own exit, after its handler ran


def test_the_warm_process_and_its_starter_leave_with_the_raylet(node):
    cwd, env, raylet, _ = node
    starter, first = _starter(cwd, env, cwd / "first.err")
    assert first["marker"]
    (zygote,) = _zygotes(env)
    assert zygote.ppid() == starter.pid  # kept in Ray's process tree by the shim that started it
    raylet.kill()
    raylet.wait()
    _gone([zygote, psutil.Process(starter.pid)])
    starter.wait()


def test_a_preload_that_fails_starts_every_worker_cold(node):
    cwd, env, _, _ = node
    env = {**env, PRELOAD_VARIABLE: "warmmarker,numpy,no_such_module_here"}
    starter, first = _starter(cwd, env, cwd / "first.err")
    runs = [_shim("report.py", "0", cwd=cwd, env=env) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    seen = [first, *(json.loads(run.stdout) for run in runs)]
    assert seen[0]["pid"] == starter.pid  # exec'd in the shim's place
    assert [s["ppid"] for s in seen[1:]] == [os.getpid()] * 2
    assert "No module named 'no_such_module_here'" in (cwd / "first.err").read_text()
    assert len(_zygotes(env)) == 1  # the failed process stays and answers at once


@pytest.mark.parametrize("unset", [PRELOAD_VARIABLE, RAYLET_VARIABLE])
def test_without_modules_or_a_raylet_workers_start_cold(node, unset):
    cwd, env, _, _ = node
    env = {k: v for k, v in env.items() if k != unset}
    run = _shim("report.py", "0", cwd=cwd, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ppid"] == os.getpid()
    assert not _zygotes(env)


def test_a_measured_worker_is_measured_though_forked(node, tmp_path):
    coverage = pytest.importorskip("coverage")
    cwd, env, _, _ = node
    rc = tmp_path / "cov.ini"
    data = tmp_path / "data" / ".coverage"
    rc.write_text(f"[run]\nparallel = true\ndata_file = {data}\nsource = {cwd}\n")
    _starter(cwd, env, cwd / "first.err")
    run = _shim("report.py", "0", cwd=cwd, env={**env, "COVERAGE_PROCESS_START": str(rc)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ppid"] != os.getpid()
    combined = coverage.Coverage(data_file=str(data), config_file=False)
    combined.combine([str(data.parent)])
    _, statements, _, missing, _ = combined.analysis2(str(cwd / "report.py"))
    assert statements and not missing


def test_the_key_leaves_out_only_what_differs_between_workers_of_one_node():
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "RAY_JOB_ID": "01000000"}
    key = zygote_key(base, "/py")
    assert (
        zygote_key({**base, "RAY_JOB_ID": "02000000", "COVERAGE_PROCESS_START": "x"}, "/py") == key
    )
    assert zygote_key({**base, "HF_HUB_OFFLINE": "0"}, "/py") != key
    assert zygote_key(base, "/other/python") != key


def test_a_job_that_picks_the_interpreter_is_left_alone():
    assert warm_runtime_env({"env_vars": {}}, ("torch",), {"conda": "env"}) == {"env_vars": {}}
    assert warm_runtime_env({"env_vars": {}}, ()) == {"env_vars": {}}
    warm = warm_runtime_env({"env_vars": {"A": "1"}}, ("torch", "transformers"))
    assert warm["env_vars"] == {"A": "1", PRELOAD_VARIABLE: "torch,transformers"}
    assert str(SHIM) in warm["py_executable"] and " -S " in warm["py_executable"]


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self) -> None:
        self.pid = os.getpid()

    def parent(self) -> tuple[int, list[str]]:
        parent = psutil.Process(self.pid).parent()
        return self.pid, parent.cmdline()


def test_ray_actors_on_this_repositorys_runtime_env_are_forked_warm(e2e_ray):
    actors = [Probe.remote() for _ in range(3)]
    seen = ray.get([actor.parent.remote() for actor in actors])
    parents = {tuple(cmdline) for _, cmdline in seen}
    assert len(parents) == 1, parents  # one warm process for the node
    (cmdline,) = parents
    assert any(part.endswith("worker_zygote.py") for part in cmdline), cmdline
    for actor in actors:
        ray.kill(actor)
    _gone([psutil.Process(pid) for pid, _ in seen if psutil.pid_exists(pid)])


INTRUDER = """\
import json, socket, struct, sys
request = json.dumps({"argv": ["report.py", "0"], "env": {}, "cwd": "/"}).encode()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + sys.argv[1])
try:
    socket.send_fds(sock, [struct.pack("!i", len(request)) + request], [0, 1, 2])
    print(len(sock.recv(4)))
except (BrokenPipeError, ConnectionResetError):  # closed before or after the request came
    print(0)
"""
SYSTEM_PYTHON = "/usr/bin/python3"  # one the user nobody may run (the venv's is under /root)


@pytest.mark.skipif(
    os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root and a system python to connect as another user",
)
def test_another_users_process_is_not_served(node):
    cwd, env, _, _ = node
    _starter(cwd, env, cwd / "first.err")
    name = _zygotes(env)[0].cmdline()[-1]  # the abstract socket's name, without its NUL
    intruder = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", INTRUDER, name],
        user="nobody",
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert intruder.stdout == "0\n", intruder.stderr  # closed without a pid: nothing forked
