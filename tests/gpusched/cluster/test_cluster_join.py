"""Nodes that join a cluster during a run take files from the next decision on.

A cluster started as users start one (``ray start``, token authentication on)
with one node of 2 simulated cards; while a run's files wait, two more nodes
join with ``RAY_AUTH_MODE=token ray start --address``: one like the others, one
whose pytest version differs (it is named in one line and not used).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from deadlines import hang_guard, wait_until

from conftest import (
    records,
    run_processes,
    start_gpusched,
    started,
    started_cluster,
    write_suite,
)

HELD = """
    import json, os, time
    import pytest

    @pytest.mark.gpu(1)
    def test_held():
        tag = os.environ["GPUSCHED_JOB_TAG"]
        with open(os.path.join({marks!r}, tag + ".start"), "w") as out:
            out.write(os.path.basename(__file__))
        start = time.time()
        while not os.path.exists({release!r}):
            time.sleep(0.1)
        time.sleep(1.0)
        with open({log!r}, "a") as out:
            out.write(json.dumps({{"file": os.path.basename(__file__), "tag": tag,
                                   "start": start, "end": time.time()}}) + "\\n")
"""
ODD = {"GPUSCHED_SIMULATE_GPUS": "2", "GPUSCHED_VERSION_OVERRIDE": '{"pytest": "0.0.1"}'}


@pytest.fixture(scope="module")
def small_cluster_shared():
    with started_cluster([{"GPUSCHED_SIMULATE_GPUS": "2"}]) as cluster:
        yield cluster


def held_file(root: Path, release: Path) -> str:
    """A one-GPU test file that records itself (as ``recording_file``) and holds its card
    until ``release`` exists."""
    (root / "marks").mkdir(exist_ok=True)
    return HELD.format(
        marks=str(root / "marks"), release=str(release), log=str(root / "record.jsonl")
    )


def test_nodes_that_join_take_files_unless_their_versions_differ(small_cluster_shared, tmp_path):
    cluster = small_cluster_shared
    release = tmp_path / "release"
    files = {f"test_f{i:02}.py": held_file(tmp_path, release) for i in range(6)}
    write_suite(tmp_path, files)
    run = start_gpusched(
        tmp_path, "run", ".", "--ray", cluster.address, "--json", "r.json", env=cluster.env()
    )
    output = tmp_path / "gpusched.out"
    try:
        # The first files hold the head's cards until the two nodes have joined (however
        # long `ray start` takes here): the others wait, so the run is still on.
        wait_until(lambda: started(tmp_path) or run.poll() is not None, 90, "the first file")
        assert started(tmp_path), output.read_text()
        for node in ({"GPUSCHED_SIMULATE_GPUS": "2"}, ODD):
            cluster.join(node)
        wait_until(
            lambda: "joined the run" in output.read_text() and "not used" in output.read_text(),
            60,
            "the driver to take in the new nodes",
        )
        release.touch()
        code = run.wait(timeout=hang_guard(120))
    finally:
        release.touch()
        if run.poll() is None:
            run.kill()
            run.wait()
    out = (tmp_path / "gpusched.out").read_text()
    assert code == 0, out
    assert out.splitlines()[-1] == "gpusched: 6 passed, 0 failed, 0 skipped", out
    joined = re.findall(
        r"^gpusched: node (\S+) \(2 simulated cards, 1 CPU slots\) joined the run$", out, re.M
    )
    refused = re.findall(r"^gpusched: node (\S+) joined but is not used: (.*)$", out, re.M)
    assert len(joined) == 1 and len(refused) == 1, out
    assert refused[0][1].endswith(f"pytest {pytest.__version__} here, 0.0.1 there"), refused
    report = json.loads((tmp_path / "r.json").read_text())
    nodes = [entry["node"] for entry in report["files"]]
    assert joined[0] in nodes, nodes  # the node that joined took files
    assert refused[0][0] not in nodes, nodes
    late = [r for r in records(tmp_path) if r["tag"].split("-")[1] == joined[0][-6:]]
    assert late and min(r["start"] for r in late) > min(r["start"] for r in records(tmp_path))
    run_id = next(iter(started(tmp_path))).split("-")[0]
    assert not run_processes(run_id)


pytestmark = pytest.mark.filterwarnings("ignore")
