"""Acceptance: the real ``gpusched run --ray`` on a real multi-raylet cluster, real pytest children.

One cluster per module (2 nodes x 4 simulated cards, 1 node x 2); a test that
needs a node to differ or to die adds its own node and removes it.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest
from deadlines import hang_guard, wait_until

from conftest import (
    RECORDING_TEST,
    extra_node,
    gpusched,
    recording_file,
    records,
    run_processes,
    start_gpusched,
    started,
    write_suite,
)


def _node_of(tag: str) -> str:
    """The node part of a job tag (``RUN-NODE-JOB-ATTEMPT``): the start of the node's id."""
    return tag.split("-")[1]


@pytest.fixture
def node_tmpdir() -> Iterator[str]:
    """An empty TMPDIR for an extra node, short enough for gpusched to put RAY_TMPDIRs under it."""
    with tempfile.TemporaryDirectory(prefix="gsn", dir="/tmp", ignore_cleanup_errors=True) as path:
        yield path


def _emptied(folder: str, quiet_bound_s: float) -> None:
    """Wait until ``folder`` is empty; fail naming what is left in it."""
    try:
        wait_until(lambda: not os.listdir(folder), quiet_bound_s, f"{folder} to be emptied")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {sorted(os.listdir(folder))}") from None


GPUS = [4, 4, 2, 2, 2, 1, 1, 1, 0, 0]  # test_f0.py ... test_f9.py: the recording files


# Logs a file's niceness (test_files_run_at_the_nodes_niceness_not_ray_workers), outside
# the measured package: the coverage figures stay those of pkg alone.
NICENESS_LINES = """
    with open({log!r}, "a") as out:
        out.write(json.dumps(os.nice(0)) + "\\n")
"""


@pytest.fixture(scope="module")
def shared_run(cluster_shared, tmp_path_factory):
    """One ``gpusched run --ray`` read by three tests (same cluster, same agents): the 10
    recording files and an 8-card file (spread over nodes), 5 files importing a package
    measured with coverage (combined from every node), the 1-card and the CPU one of which
    also log their niceness."""
    root = tmp_path_factory.mktemp("run")
    files = {f"test_f{i}.py": recording_file(root, n, 1.5) for i, n in enumerate(GPUS)}
    files["test_huge.py"] = "import pytest\n\n@pytest.mark.gpu(8)\ndef test_huge():\n    pass\n"
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    for i, gpus in enumerate([4, 4, 2, 1, 0]):
        (root / "pkg" / f"m{i}.py").write_text(f"def f(x):\n    if x:\n        return {i}\n")
        marker = f"@pytest.mark.gpu({gpus})" if gpus else ""
        nice = NICENESS_LINES.format(log=str(root / "nice.jsonl")) if gpus <= 1 else ""
        files[f"test_m{i}.py"] = (
            f"import json, os\nimport pytest\nfrom pkg.m{i} import f\n\n{marker}\n"
            f"def test_f():\n    assert f(1) == {i}\n{nice}"
        )
    write_suite(root, files)
    result = gpusched(
        root, "run", ".", "--ray", cluster_shared.address,
        "--json", "report.json", "--junitxml", "junit.xml", "--timeline", "timeline.html",
        "--", "--cov=pkg", "--cov-report=term-missing",
    )  # fmt: skip
    return root, result


def test_files_spread_over_nodes_on_node_local_cards(shared_run):
    tmp_path, result = shared_run
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    # 10 recording files + 5 coverage files passed; the 8-card file skipped.
    assert result.stdout.splitlines()[-1] == "gpusched: 15 passed, 0 failed, 1 skipped", out
    report = json.loads((tmp_path / "report.json").read_text())
    by_file = {entry["path"].rsplit("/", 1)[-1]: entry for entry in report["files"]}
    huge = by_file["test_huge.py"]
    assert huge["outcome"] == "SKIPPED"
    assert huge["message"].startswith("needs 8 GPUs, the largest node ("), huge["message"]
    assert huge["message"].endswith(") has 4")

    ran = records(tmp_path)
    assert len(ran) == len(GPUS)
    nodes = {_node_of(r["tag"]) for r in ran}
    assert len(nodes) == 3, f"files ran on {nodes} only"
    for r in ran:
        entry = by_file[r["file"]]
        cards = [c for c in r["cards"].split(",") if c]
        assert cards == entry["cards"], (r, entry)  # the child's own cards are the reported ones
        assert len(cards) == GPUS[int(r["file"][6:-3])]
        assert entry["node"].endswith(_node_of(r["tag"])), (r, entry)
        small = f"{entry['node']} (2 simulated cards" in result.stdout
        assert set(cards) <= ({"0", "1"} if small else {"0", "1", "2", "3"}), (r, entry)
    # Node-local card ids are never shared by two files running at once on one node.
    for a in ran:
        for b in ran:
            if a is b or _node_of(a["tag"]) != _node_of(b["tag"]):
                continue
            shared = set(a["cards"].split(",")) & set(b["cards"].split(",")) - {""}
            if shared:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)
    # Concurrency: files on different nodes overlap in time.
    overlapping = [
        (a["file"], b["file"])
        for a in ran
        for b in ran
        if _node_of(a["tag"]) != _node_of(b["tag"])
        and a["start"] < b["end"]
        and b["start"] < a["end"]
    ]
    assert overlapping, "no two files on different nodes ran at the same time"

    suites = ET.parse(tmp_path / "junit.xml").getroot()
    props = {
        suite.get("name"): {p.get("name"): p.get("value") for p in suite.iter("property")}
        for suite in suites.iter("testsuite")
    }
    assert props["test_f0.py"]["node"] == by_file["test_f0.py"]["node"]
    assert props["test_f0.py"]["cards"] == ",".join(by_file["test_f0.py"]["cards"])
    page = (tmp_path / "timeline.html").read_text()
    for name in {entry["node"] for entry in report["files"] if entry["node"]}:
        assert f"{name} gpu 0" in page


def test_version_mismatch_is_refused_naming_the_node(cluster_shared, tmp_path):
    import pytest as pytest_module

    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    odd = {"GPUSCHED_SIMULATE_GPUS": "1", "GPUSCHED_VERSION_OVERRIDE": '{"pytest": "0.0.1"}'}
    with extra_node(cluster_shared, odd) as node:
        result = gpusched(tmp_path, "run", ".", "--ray", cluster_shared.address)
    assert result.returncode == 4, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("gpusched: error: the nodes must run the same"), error
    assert f"-{node.node_id[:6]}: pytest {pytest_module.__version__} here, 0.0.1 there" in error
    assert error.count("node ") == 1, error  # only the odd node is named
    assert not records(tmp_path)


def test_node_removed_mid_run_has_its_files_run_elsewhere(cluster_shared, tmp_path, node_tmpdir):
    files = {f"test_big{i}.py": recording_file(tmp_path, 4, 3.0) for i in range(3)}
    write_suite(tmp_path, files)
    node_env = {"GPUSCHED_SIMULATE_GPUS": "4", "TMPDIR": node_tmpdir}
    with extra_node(cluster_shared, node_env) as node:
        short = node.node_id[:6]
        proc = start_gpusched(
            tmp_path, "run", ".", "--ray", cluster_shared.address, "--json", "r.json"
        )
        try:
            on_it = wait_until(
                lambda: [t for t in started(tmp_path) if _node_of(t) == short],
                60,
                "a file on the extra node",
            )
            cluster_shared.remove_node(node, allow_graceful=False)
            code = proc.wait(timeout=hang_guard(60))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = (tmp_path / "gpusched.out").read_text()
    assert code == 0, out
    assert out.splitlines()[-1] == "gpusched: 3 passed, 0 failed, 0 skipped", out
    assert f"-{short} left the run" in out
    report = json.loads((tmp_path / "r.json").read_text())
    moved = [e for e in report["files"] if "ran again after node" in e["message"]]
    assert [e["path"].rsplit("/", 1)[-1] for e in moved] == [started(tmp_path)[on_it[0]]]
    assert not moved[0]["node"].endswith(short)
    assert all(e["outcome"] == "PASSED" for e in report["files"])
    # The lost node's file did not outlive its node: its watchdog killed it.
    run_id = on_it[0].split("-")[0]
    wait_until(
        lambda: not [p for p in run_processes(f"{run_id}-{short}")],
        15,
        "the lost node's files to be gone",
    )
    assert not run_processes(run_id)
    # Nor did its temporary files: the agent's work dir, its files' RAY_TMPDIRs, the fork
    # server's warm-up dir (its watchdog removed them).
    _emptied(node_tmpdir, 15)


def test_ctrl_c_kills_every_file_on_every_node(cluster_shared, tmp_path):
    gpus = [4, 4, 2, 0, 1]
    files = {
        f"test_s{i}.py": recording_file(tmp_path, n, 300, escapee=True) for i, n in enumerate(gpus)
    }
    write_suite(tmp_path, files)
    proc = start_gpusched(
        tmp_path,
        "run",
        ".",
        "--ray",
        cluster_shared.address,
        "--json",
        "r.json",
        "--kill-grace",
        "2",
    )
    try:
        tags = wait_until(
            lambda: len(started(tmp_path)) >= 3 and started(tmp_path), 60, "three running files"
        )
        run_id = next(iter(tags)).split("-")[0]
        assert run_processes(run_id)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=hang_guard(20))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "gpusched.out").read_text()
    assert code == 2, out
    assert out.splitlines()[-1] == "gpusched: 0 passed, 0 failed, 0 skipped", out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and report["exit_code"] == 2
    outcomes = {e["path"].rsplit("/", 1)[-1]: e["outcome"] for e in report["files"]}
    assert set(outcomes) == set(files)
    assert {outcomes[name] for name in set(started(tmp_path).values())} == {"INTERRUPTED"}
    assert set(outcomes.values()) <= {"INTERRUPTED", "NOT RUN"}
    assert len({_node_of(tag) for tag in started(tmp_path)}) >= 2
    left = run_processes(run_id)
    assert not left, [(p.pid, p.name()) for p in left]


def test_plan_predicts_the_makespan_across_nodes(cluster_shared, tmp_path):
    write_suite(
        tmp_path,
        {
            "test_a.py": "import pytest\n\n@pytest.mark.gpu(4)\ndef test_a():\n    pass\n",
            "test_b.py": "import pytest\n\n@pytest.mark.gpu(4)\ndef test_b():\n    pass\n",
            "test_c.py": "import pytest\n\n@pytest.mark.gpu(2)\ndef test_c():\n    pass\n",
            "test_d.py": "import pytest\n\n@pytest.mark.gpu(3)\ndef test_d():\n    pass\n",
        },
    )
    result = gpusched(tmp_path, "plan", ".", "--ray", cluster_shared.address)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "predicted schedule on 3 nodes" in result.stdout
    # Every file has the mean duration (no history): 4+4+2 fit at once, the 3-card file waits.
    assert lines[-1] == "gpusched: predicted makespan 2.0s for 4 files on 3 nodes", result.stdout
    schedule = [line for line in lines if "s -> " in line]
    assert len({line.split("[")[1].split(" gpu")[0] for line in schedule}) == 3


def test_files_run_at_the_nodes_niceness_not_ray_workers(shared_run):
    """Ray starts its workers at niceness 15; the agent's files would starve beside the
    node's other processes (and time out where they pass locally). Read from the run of
    ``shared_run``: its 1-card file and a CPU file log their niceness."""
    root, result = shared_run
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads(line) for line in (root / "nice.jsonl").read_text().splitlines()]
    # The raylets inherited this process's niceness: the files have the same (not 15 more).
    assert seen == [os.nice(0)] * 2


def test_unknown_address_is_a_usage_error(tmp_path):
    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    result = gpusched(tmp_path, "run", ".", "--ray", "127.0.0.1:9")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "gpusched: error: --ray 127.0.0.1:9: " in result.stderr


def test_simulated_cards_on_the_driver_are_refused_with_ray(tmp_path):
    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    result = gpusched(tmp_path, "run", ".", "--ray", "auto", "--simulate-gpus", "2")
    assert result.returncode == 4
    assert "--simulate-gpus picks the cards of one machine" in result.stderr


pytestmark = pytest.mark.filterwarnings("ignore")


GATE = """
    import os, time

    # Collection of this file ends only once some file of the run has started.
    deadline = time.time() + 300
    while not os.listdir({marks!r}) and time.time() < deadline:
        time.sleep(0.05)
    with open({gate!r}, "a") as out:
        out.write(f"{{time.time()}} {{bool(os.listdir({marks!r}))}}\\n")

    def test_gate():
        pass
"""


def recording(tmp_path, marker: str) -> str:
    return RECORDING_TEST.format(
        marker=marker,
        sleep=0.5,
        log=str(tmp_path / "record.jsonl"),
        marks=str(tmp_path / "marks"),
        escapee=False,
        release=None,
    )


def test_files_start_while_collecting_and_a_changed_requirement_is_placed_again(
    cluster_shared, tmp_path
):
    """The collection cache is warmed by a plain ``gpusched plan`` (no cluster needed); then a
    helper module changes the marker of a cached file (its cache key cannot see that), and a
    new file joins whose import waits until some file has started: the run ends only if
    files start on the nodes while the collection still runs."""
    (tmp_path / "marks").mkdir()
    write_suite(
        tmp_path,
        {
            "helpers.py": "import pytest\nneeds = pytest.mark.gpu(1)\n",
            "test_a.py": recording(tmp_path, ""),
            "test_b.py": recording(tmp_path, "from helpers import needs\n    @needs"),
        },
    )
    warm = gpusched(tmp_path, "plan", ".")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    cache = json.loads((tmp_path / ".gpusched" / "collection.json").read_text())
    assert cache["files"]["test_b.py"]["gpus"] == 1

    (tmp_path / "helpers.py").write_text("import pytest\nneeds = pytest.mark.gpu(2)\n")
    gate = tmp_path / "gate.log"
    write_suite(
        tmp_path, {"test_gate.py": GATE.format(marks=str(tmp_path / "marks"), gate=str(gate))}
    )
    result = gpusched(
        tmp_path, "run", ".", "--ray", cluster_shared.address, "--json", "r.json", timeout=60
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert result.stdout.splitlines()[-1] == "gpusched: 3 passed, 0 failed, 0 skipped", out

    # The collection's import of test_gate.py saw a file already started.
    collected_at, saw_a_start = gate.read_text().splitlines()[0].split()
    assert saw_a_start == "True", out
    first_start = min(r["start"] for r in records(tmp_path))
    assert first_start < float(collected_at)

    # test_b.py: predicted 1 card, found 2 by its child before any test ran, placed again
    # on 2 cards: its test ran once, there.
    assert "test_b.py needs 2 GPUs, not the 1 GPU the collection cache predicted" in out
    (b,) = [r for r in records(tmp_path) if r["file"] == "test_b.py"]
    assert len(b["cards"].split(",")) == 2
    report = json.loads((tmp_path / "r.json").read_text())
    by_name = {entry["path"].rsplit("/", 1)[-1]: entry for entry in report["files"]}
    assert by_name["test_b.py"]["attempts"] == 1 and len(by_name["test_b.py"]["cards"]) == 2
    assert sorted(len(node["cards"]) for node in report["nodes"].values()) == [2, 4, 4]
    cache = json.loads((tmp_path / ".gpusched" / "collection.json").read_text())
    assert "test_b.py" not in cache["files"]  # forgotten: the next run collects it
    assert "test_gate.py" in cache["files"]  # collected this time: remembered


def test_coverage_of_every_node_is_combined_on_the_drivers_paths(shared_run):
    tmp_path, result = shared_run
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert result.stdout.count("tests coverage") == 1, out
    [total] = [line.split() for line in result.stdout.splitlines() if line.startswith("TOTAL")]
    assert total == ["TOTAL", "15", "0", "100%"], out
    assert "working_dir" not in out and "/tmp/ray" not in out, out
    import coverage

    data = coverage.CoverageData(str(tmp_path / ".coverage"))
    data.read()
    measured = {os.path.relpath(path, tmp_path): data.lines(path) for path in data.measured_files()}
    assert all(not path.startswith("..") for path in measured), measured  # only the checkout
    for i in range(5):
        assert sorted(measured[f"pkg/m{i}.py"]) == [1, 2, 3], measured
