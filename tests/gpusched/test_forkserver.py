"""The fork server: isolation between files, cards after a preloaded torch, sweeps, fallbacks.

End-to-end tests run the real ``gpusched run`` on small suites; the pure
pieces (preload discovery, the environ rewrite, the option values) are tested
directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard, wait_until

from gpusched.execution.forkclient import ForkServer, ServerSpec, new_run_id
from gpusched.execution.forkserver import PAD_VARIABLE, import_preload, retag_environ_block
from gpusched.execution.preload import (
    auto_preload,
    conftest_files,
    fork_unavailable,
    is_third_party,
    module_level_imports,
)
from gpusched.history import Entry
from gpusched.options import UsageError, resolve
from gpusched.scheduling.earlystart import early_picks

# Written by the test files below: which process they ran in and what they saw.
PARENT_PROBE = """
import json, os, sys
import psutil
from pathlib import Path

def probe(name):
    parent = " ".join(psutil.Process(os.getppid()).cmdline())
    Path(__file__).with_name(name + ".json").write_text(json.dumps({
        "forked": "forkserver.py" in parent,
        "leak_env": os.environ.get("GS_LEAK"),
        "leak_path": "/gs-leak" in sys.path,
        "leak_attr": getattr(json, "gs_leak", None),
        "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }))
"""

POLLUTER = """
import json, os, sys
from probe import probe

def test_pollute(monkeypatch):
    probe("a_before")
    os.environ["GS_LEAK"] = "from a"
    sys.path.append("/gs-leak")
    json.gs_leak = "from a"          # a module attribute, set for good
    monkeypatch.setattr(os, "getcwd", lambda: "/nowhere")  # undone by pytest, too
"""

VICTIM = """
from probe import probe

def test_clean():
    probe("b")
"""


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


def test_state_changed_by_one_file_does_not_reach_the_next(make_suite, run_gpusched, tmp_path):
    make_suite({"probe.py": PARENT_PROBE, "test_a.py": POLLUTER, "test_b.py": VICTIM})
    result = run_gpusched("run", ".", "--cpu-slots", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off" not in result.stdout
    before, after = _report(tmp_path / "a_before.json"), _report(tmp_path / "b.json")
    assert before["forked"] and after["forked"], "both files ran in children of the fork server"
    assert after == {**before, "cards": after["cards"]}
    assert after["leak_env"] is None and not after["leak_path"] and after["leak_attr"] is None


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_test_that_breaks_json_dumps_passes_as_under_plain_pytest(
    mode, make_suite, run_gpusched, run_pytest
):
    make_suite(
        {
            "test_json.py": """
                import json

                def test_break_json():
                    json.dumps = None

                def test_after():
                    assert json.dumps is None
                """
        }
    )
    assert run_pytest("test_json.py").returncode == 0
    result = run_gpusched("run", ".", "--fork-server", mode, "--json", "r.json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "gpusched: 2 passed, 0 failed, 0 skipped"


def test_cards_are_the_assigned_ones_although_the_server_imported_torch(
    make_suite, run_gpusched, tmp_path
):
    pytest.importorskip("torch")
    probe = textwrap.dedent("""
        import ctypes, json, os, sys
        from pathlib import Path
        import pytest
        import torch

        @pytest.mark.gpu{n}
        def test_cards():
            libc = ctypes.CDLL(None)
            libc.getenv.restype = ctypes.c_char_p
            Path(__file__).with_name(Path(__file__).stem + ".json").write_text(json.dumps({{
                "environ": os.environ["CUDA_VISIBLE_DEVICES"],
                "getenv": libc.getenv(b"CUDA_VISIBLE_DEVICES").decode(),
                "preloaded": PRELOADED,
                "cuda_initialised": torch.cuda.is_initialized(),
            }}))
        """)
    make_suite(
        {
            # Records whether torch was imported before the suite's own code ran.
            "conftest.py": "import sys\nPRELOADED = 'torch' in sys.modules\nimport torch\n",
            "test_one.py": "from conftest import PRELOADED\n" + probe.format(n=1),
            "test_two.py": "from conftest import PRELOADED\n" + probe.format(n=2),
        }
    )
    result = run_gpusched("run", ".", "--simulate-gpus", "3", "--json", "r.json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = _report(tmp_path / "r.json")
    for entry in report["files"]:
        seen = _report(Path(entry["path"]).with_suffix(".json"))
        assigned = ",".join(entry["cards"])
        assert len(entry["cards"]) in (1, 2)
        assert seen == {
            "environ": assigned,
            "getenv": assigned,  # what CUDA itself would read at initialisation
            "preloaded": True,
            "cuda_initialised": False,
        }


FORK_ESCAPEE = """
import os, time
from pathlib import Path

def test_fork_escapee():
    # No exec anywhere: the escapee shows the fork server's /proc/PID/environ block,
    # rewritten with this job's tag by the child.
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        os.setpgrp()
        Path(__file__).with_name("escapee.pid").write_text(str(os.getpid()))
        time.sleep(300)
        os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 10
    while not Path(__file__).with_name("escapee.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.timeout(hang_guard(60))
def test_a_forked_setsid_escapee_is_swept_by_its_tag(make_suite, run_gpusched, tmp_path):
    make_suite({"test_escape.py": FORK_ESCAPEE})
    result = run_gpusched("run", ".", "--json", "r.json")
    pid = int((tmp_path / "escapee.pid").read_text())
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        entry = _report(tmp_path / "r.json")["files"][0]
        assert entry["swept"] == 1
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()


THREAD_STARTER = """
import threading, time
threading.Thread(target=time.sleep, args=(30,), name="starter", daemon=True).start()
"""


def test_a_preload_that_starts_a_thread_means_fresh_processes_said_once(make_suite, run_gpusched):
    make_suite(
        {
            "threadstarter.py": THREAD_STARTER,
            "test_a.py": "def test_a():\n    pass\n",
            "test_b.py": "def test_b():\n    pass\n",
        }
    )
    result = run_gpusched("run", ".", "--preload", "threadstarter")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "fork server off" in line]
    assert len(lines) == 1, result.stdout
    assert "threadstarter" in lines[0] and "starter" in lines[0]


def test_an_unsafe_automatic_preload_is_dropped_and_the_server_kept(
    make_suite, run_gpusched, tmp_path
):
    make_suite(
        {
            "site-packages/threadlib.py": THREAD_STARTER,
            "site-packages/quietlib.py": "VALUE = 1\n",
            "conftest.py": "import quietlib\nimport threadlib\nfrom threadlib import time\n",
            "test_a.py": "import sys\n\ndef test_a():\n    assert 'quietlib' in sys.modules\n",
        }
    )
    result = run_gpusched("run", ".", PYTHONPATH=str(tmp_path / "site-packages"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off" not in result.stdout
    # both entries of the package go at once: one restart of the server, one line
    assert (
        "preload: threadlib, threadlib:time not preloaded (Python thread(s) running: starter)"
        in result.stdout
    )


def test_a_server_slower_to_start_than_a_small_collect_timeout_is_waited_for(
    make_suite, run_gpusched
):
    # Its preload takes longer than --collect-timeout; that bounds the collection, which
    # starts once the server is ready, and a loaded machine needs seconds for `import torch`.
    # (5 s, not less: beside two busy processes at a slow hour, collecting this one file
    # took more than 2 s.)
    make_suite(
        {
            "slowstart.py": "import time\ntime.sleep(8)\n",
            "test_a.py": "import sys\n\ndef test_a():\n    assert 'slowstart' in sys.modules\n",
        }
    )
    result = run_gpusched("run", ".", "--preload", "slowstart", "--collect-timeout", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off" not in result.stdout


def test_a_user_preload_that_does_not_import_is_named(make_suite, run_gpusched):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    result = run_gpusched("run", ".", "--preload", "no_such_module_here")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off for this run: preload 'no_such_module_here' failed" in result.stdout


# ---------------------------------------------------------------- pure pieces


def test_module_level_imports_are_found_but_not_those_inside_functions():
    source = """
import torch, numpy.linalg
from transformers import AutoModel
from . import local
try:
    import ray
except ImportError:
    ray = None
if TYPE_CHECKING:
    import typing_only
def fixture():
    import lazy
"""
    assert module_level_imports(source) == ["torch", "numpy", "transformers", "ray"]
    assert module_level_imports("def broken(:\n") == []


def test_third_party_means_installed_and_not_the_suite_or_stdlib(tmp_path, monkeypatch):
    (tmp_path / "mylocal.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert is_third_party("pytest", tmp_path)
    assert not is_third_party("json", tmp_path)
    assert not is_third_party("mylocal", tmp_path)
    assert not is_third_party("surely_not_installed_xyz", tmp_path)


def test_auto_preload_reads_the_conftest_chain(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "conftest.py").write_text("import psutil\nimport json\n")
    (tmp_path / "tests" / "conftest.py").write_text("import pytest\nimport mylocal\n")
    (tmp_path / "tests" / "unit" / "test_x.py").write_text("import rich\n")
    found = conftest_files([str(tmp_path / "tests" / "unit" / "test_x.py")], tmp_path)
    assert found == [tmp_path / "conftest.py", tmp_path / "tests" / "conftest.py"]
    assert auto_preload([str(tmp_path / "tests")], tmp_path) == ["psutil", "pytest"]


def test_a_preload_entry_imports_as_its_statement_would(monkeypatch):
    for name in [n for n in sys.modules if n == "xml" or n.startswith("xml.")]:
        monkeypatch.delitem(sys.modules, name)
    import_preload("xml:dom")  # not an attribute of xml until imported: the submodule
    assert "xml.dom" in sys.modules
    import_preload("xml.dom:minidom")
    assert "xml.dom.minidom" in sys.modules
    import_preload("json:dumps")  # an attribute
    with pytest.raises(ModuleNotFoundError):
        import_preload("json:no_such_name")
    with pytest.raises(ModuleNotFoundError):
        import_preload("surely_not_installed_xyz")


@pytest.mark.parametrize(
    ("platform", "safe"), [("linux", True), ("darwin", False), ("win32", False)]
)
def test_only_linux_forks(platform, safe):
    assert (fork_unavailable(platform) is None) == safe


def test_retag_keeps_the_block_length_and_every_other_entry():
    placeholder = "fs-run-".ljust(64, "_")
    block = f"A=1\0GPUSCHED_JOB_TAG={placeholder}\0B=2\0".encode()
    new = retag_environ_block(block, placeholder.encode(), "run-3-1")
    assert new is not None and len(new) == len(block)
    entries = [e for e in new.decode().split("\0") if e]
    assert entries[:2] == ["A=1", "GPUSCHED_JOB_TAG=run-3-1"]
    assert entries[2].startswith(PAD_VARIABLE + "=") and entries[3] == "B=2"
    assert retag_environ_block(b"A=1\0", placeholder.encode(), "t") is None
    assert retag_environ_block(block, placeholder.encode(), "t" * 80) is None


def test_fork_server_and_preload_options_from_every_source():
    names = frozenset({"fork_server", "preload"})
    assert resolve({}, {}, {}, names) == {"fork_server": True, "preload": ()}
    table = {"fork_server": "off", "preload": ["torch", "transformers"]}
    assert resolve({}, {}, table, names) == {
        "fork_server": False,
        "preload": ("torch", "transformers"),
    }
    env = {"GPUSCHED_PRELOAD": "torch, ray", "GPUSCHED_FORK_SERVER": "on"}
    assert resolve({}, env, table, names) == {"fork_server": True, "preload": ("torch", "ray")}
    with pytest.raises(UsageError, match="--fork-server: 'maybe' must be on or off"):
        resolve({"fork_server": "maybe"}, {}, {}, names)
    with pytest.raises(UsageError, match="GPUSCHED_PRELOAD: 'torch;ray' names 'torch;ray'"):
        resolve({}, {"GPUSCHED_PRELOAD": "torch;ray"}, {}, names)
    entries = {"preload": "transformers:LlamaForCausalLM,torch.distributed"}
    assert resolve(entries, {}, {}, names)["preload"] == (
        "transformers:LlamaForCausalLM",
        "torch.distributed",
    )
    for bad in ("transformers:", "transformers:a.b", ":x", "a:b:c"):
        with pytest.raises(UsageError, match=f"--preload: '{bad}' names '{bad}'"):
            resolve({"preload": bad}, {}, {}, names)


def test_the_server_and_its_children_are_gone_after_a_run(make_suite, run_gpusched, tmp_path):
    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    started = time.time()
    result = run_gpusched("run", ".")
    assert result.returncode == 0, result.stdout + result.stderr
    left = []
    for proc in psutil.process_iter(["cmdline", "create_time", "cwd"]):
        info = proc.info
        if (
            info["create_time"]
            and info["create_time"] >= started - 1
            and info["cwd"] == str(tmp_path)
        ):
            left.append(" ".join(info["cmdline"] or []))
    assert left == [], left
    assert os.path.exists(tmp_path / ".gpusched" / "logs" / "forkserver.log")


# ``gpusched run .`` whose meter never scans: what it records can only come from wait statuses.
RUN_UNSCANNED = """
import functools, sys
from gpusched.execution import proctree, runner
runner.CpuMeter = functools.partial(proctree.CpuMeter, interval=3600.0)
from gpusched.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_files_cpu_use_is_counted_from_its_wait_status_up_to_its_exit(
    make_suite, run_gpusched, tmp_path
):
    """The meter scans every few seconds, and misses what a process used after its last scan
    and any file shorter than a scan; the server's ``wait4`` gives what the file's process and
    the children it reaped used, to the end. Here no scan ever runs."""
    burn = 0.6
    make_suite(
        {
            "conftest.py": f"""
                import time

                def pytest_unconfigure(config):  # pytest's last hook: the process exits next
                    while time.process_time() < {burn}:
                        pass
            """,
            "test_quick.py": "def test_quick():\n    pass\n",
        }
    )
    done = run_gpusched("run", ".", via=("-c", RUN_UNSCANNED))
    assert done.returncode == 0, done.stdout + done.stderr
    history = json.loads((tmp_path / ".gpusched" / "durations.json").read_text())
    entry = history["files"]["test_quick.py"]
    assert entry["cpu"] * entry["seconds"] >= burn * 0.9, entry
    assert entry["peak"] >= entry["cpu"], entry


# ---------------------------------------------------------------- early starts

SLOW = "import time\n\ndef test_slow():\n    time.sleep(1.0)\n"
FAST = "def test_fast():\n    pass\n"


def test_the_longest_known_file_starts_during_collection_and_is_adopted(
    make_suite, run_gpusched, tmp_path
):
    make_suite({"test_slow.py": SLOW, "test_fast.py": FAST})
    first = run_gpusched("run", ".")
    assert first.returncode == 0 and "started before collection" not in first.stdout
    second = run_gpusched("run", ".", "--json", "r.json")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 files on no GPUs and 2 CPU slots (1 started before collection)" in second.stdout
    files = {Path(f["path"]).name: f for f in _report(tmp_path / "r.json")["files"]}
    assert files["test_slow.py"]["outcome"] == "PASSED"
    assert [t["outcome"] for t in files["test_slow.py"]["tests"]] == ["passed"]
    assert files["test_slow.py"]["start"] < files["test_fast.py"]["start"]
    assert second.stdout.strip().splitlines()[-1] == "gpusched: 2 passed, 0 failed, 0 skipped"


def test_an_early_file_with_no_selected_test_is_not_reported(make_suite, run_gpusched, tmp_path):
    make_suite({"test_slow.py": SLOW.replace("1.0", "600"), "test_fast.py": FAST})
    (tmp_path / ".gpusched").mkdir()
    (tmp_path / ".gpusched" / "durations.json").write_text(
        json.dumps(
            {"version": 1, "files": {"test_slow.py": {"seconds": 600, "last": 600, "runs": 1}}}
        )
    )
    started = time.monotonic()
    result = run_gpusched("run", ".", "-k", "fast", "--json", "r.json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - started < 300  # the 600 s file did not hold the run
    names = [Path(f["path"]).name for f in _report(tmp_path / "r.json")["files"]]
    assert names == ["test_fast.py"]
    assert not (tmp_path / ".gpusched" / "logs" / "test_slow.py.log").exists()


def test_early_picks_are_the_longest_known_files_under_the_paths(tmp_path):
    history = {
        "tests/a.py": Entry(9.0, 9.0, 1),
        "tests/b.py": Entry(5.0, 5.0, 1),
        "other/c.py": Entry(20.0, 20.0, 1),
        "tests/tiny.py": Entry(0.1, 0.1, 1),
        "tests/gone.py": Entry(30.0, 30.0, 1),
    }
    exists = lambda path: path.name != "gone.py"  # noqa: E731
    tests = str(tmp_path / "tests")
    assert early_picks(history, tmp_path, [tests], 3, exists) == [
        str(tmp_path / "tests" / "a.py"),
        str(tmp_path / "tests" / "b.py"),
    ]
    assert early_picks(history, tmp_path, [tests], 2, exists) == [str(tmp_path / "tests/a.py")]
    assert early_picks(history, tmp_path, [tests], 1, exists) == []
    assert early_picks(history, tmp_path, [tests + "/a.py::test_x"], 4, exists) == []


def _run_killing_the_server(tmp_path: Path, when) -> tuple[str, list[dict]]:
    """``gpusched run`` on the suite in ``tmp_path``; its fork server is killed once ``when(server)``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "CUDA_VISIBLE"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpusched", "run", ".", "--cpu-slots", "1", "--json", "r.json"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        server = None
        deadline = time.monotonic() + 60
        while server is None and time.monotonic() < deadline:
            for child in psutil.Process(proc.pid).children():
                if any("forkserver.py" in part for part in child.cmdline()) and when(child):
                    server = child
            time.sleep(0.02)
        assert server is not None, "the fork server never reached the moment to kill it"
        server.kill()
        out, _ = proc.communicate(timeout=hang_guard(90))
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, _report(tmp_path / "r.json")["files"]


def _has_forked_a_child(server: psutil.Process) -> bool:
    """A child forked for a request leads its own process group; anything a plugin runs while
    the server starts (pytest-benchmark runs ``git``) stays in the server's."""
    for child in server.children():
        try:
            if os.getpgid(child.pid) == child.pid:
                return True
        except ProcessLookupError:
            pass
    return False


SLEEPER = "import time\n\ndef test_sleep():\n    time.sleep(1.5)\n"


@pytest.mark.timeout(hang_guard(120))
def test_a_server_that_dies_mid_run_leaves_later_files_to_fresh_processes(make_suite, tmp_path):
    make_suite({f"test_{i}.py": SLEEPER for i in range(3)})
    first_file_runs = (tmp_path / ".gpusched" / "logs" / "test_0.py.log").exists
    out, files = _run_killing_the_server(tmp_path, lambda server: first_file_runs())
    assert "fork server exited" in out and "later files started fresh processes" in out, out
    assert len(files) == 3
    assert [f["outcome"] for f in files].count("PASSED") >= 2, out  # those after its death


@pytest.mark.timeout(hang_guard(120))
def test_a_server_that_dies_during_collection_leaves_it_to_a_fresh_process(make_suite, tmp_path):
    make_suite(
        {
            "conftest.py": "import time\ntime.sleep(2)\n",  # a slow collection to die in
            **{f"test_{i}.py": SLEEPER.replace("1.5", "0") for i in range(2)},
        }
    )
    out, files = _run_killing_the_server(tmp_path, _has_forked_a_child)
    assert [f["outcome"] for f in files] == ["PASSED", "PASSED"], out
    assert "later files started fresh processes" in out, out


SERVER_FINALIZER = """
import os, tempfile, weakref

SCRATCH = tempfile.TemporaryDirectory(prefix="preloaded-")  # removed at exit by a finalizer


class Holder:
    pass


HOLDER = Holder()
weakref.finalize(HOLDER, lambda: open(os.environ["FINALIZED"], "a").write("server\\n"))
"""

USES_SCRATCH = """
import os, weakref
import finalizing


class Mine:
    pass


MINE = Mine()
weakref.finalize(MINE, lambda: open(os.environ["FINALIZED"], "a").write("child\\n"))


def test_the_preloaded_scratch_directory_is_still_there():
    assert os.path.isdir(finalizing.SCRATCH.name)
"""


def test_children_leave_the_servers_exit_finalizers_to_the_server(
    make_suite, run_gpusched, tmp_path
):
    """A preload's temporary directory survives every child; a child's own finalizer runs."""
    make_suite(
        {
            "finalizing.py": SERVER_FINALIZER,
            **{f"test_s{i}.py": USES_SCRATCH for i in range(3)},
        }
    )
    log = tmp_path / "finalized.log"
    result = run_gpusched(
        "run",
        ".",
        "--preload",
        "finalizing",
        "--cpu-slots",
        "1",
        "--simulate-gpus",
        "1",
        FINALIZED=str(log),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off" not in result.stdout
    lines = log.read_text().split()
    # Each process that imported a test module ran its own finalizer at exit: the
    # collection child and the file's child, three files each.
    assert lines.count("child") == 6
    assert lines.count("server") == 1  # the server's ran once, when the server exited


def test_a_server_killed_during_its_warm_up_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    """A sweep may kill the server before it is ready (its agent died): none of its files stay."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the server's, as the runner's environment
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's, read once and kept
    spec = ServerSpec((), (), os.environ, tmp_path / "forkserver.log", new_run_id(), 60.0)
    server = ForkServer.launch(spec, wait=False)
    try:
        wait_until(lambda: list(tmp.iterdir()), 30, "the warm-up directory", poll_s=0.01)
        server.proc.send_signal(signal.SIGKILL)  # as the sweep's KILL: no chance to clean up
        server.proc.wait()
    finally:
        server.close(wait=0.0)
    assert list(tmp.iterdir()) == []


def test_a_run_that_fails_before_using_its_early_server_kills_it(make_suite, tmp_path, monkeypatch):
    """The command line starts the server before the session; a usage error still ends it."""
    import importlib.util

    from gpusched import cli

    make_suite({"test_a.py": "def test_a():\n    pass\n"})
    monkeypatch.chdir(tmp_path)
    started = []
    real_start = cli.start_early_server

    def spy(*args, **kwargs):
        result = real_start(*args, **kwargs)
        started.append(result)
        return result

    real_find = importlib.util.find_spec
    monkeypatch.setattr(cli, "start_early_server", spy)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "pytest_timeout" else real_find(name, *rest),
    )
    assert cli.main(["run", ".", "--per-test-timeout", "5"]) == 4
    (early,) = started
    assert early is not None and not early.taken
    assert early.server.proc.poll() is not None  # killed, not left to finish its imports


def test_a_childs_tests_see_the_real_installed_distributions(make_suite, run_gpusched):
    """The server answers pytest's start-up from parsed metadata; the tests get the real thing."""
    make_suite(
        {
            "test_meta.py": """
                import importlib.metadata


                def test_distributions_is_the_standard_function():
                    assert importlib.metadata.distributions.__module__ == "importlib.metadata"
                    assert importlib.metadata.version("pytest")
                """
        }
    )
    result = run_gpusched("run", ".")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fork server off" not in result.stdout


def test_a_childs_config_is_its_own_with_or_without_p_arguments(make_suite, run_gpusched):
    """Children start from a config the server prebuilt: their arguments and -p still count."""
    make_suite(
        {
            "test_config.py": """
                import os
                from _pytest.config import get_config


                def test_config_is_this_files(pytestconfig):
                    args = pytestconfig.invocation_params.args
                    assert any(arg.endswith("test_config.py") for arg in args)
                    assert pytestconfig.invocation_params.dir == pytestconfig.rootpath
                    blocked = pytestconfig.pluginmanager.is_blocked("cacheprovider")
                    assert blocked == (os.environ.get("EXPECT_BLOCKED") == "1")
                    assert get_config() is not pytestconfig  # a test gets a fresh one
                """
        }
    )
    plain = run_gpusched("run", ".")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    blocked = run_gpusched("run", ".", "--", "-p", "no:cacheprovider", EXPECT_BLOCKED="1")
    assert blocked.returncode == 0, blocked.stdout + blocked.stderr
    assert "fork server off" not in plain.stdout + blocked.stdout
