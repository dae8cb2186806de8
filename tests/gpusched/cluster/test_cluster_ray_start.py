"""Acceptance: ``gpusched run --ray`` on a cluster started as users start one, token auth on.

The head is ``ray start --head``, the second node ``RAY_AUTH_MODE=token ray start
--address``, each with its own simulated cards, after ``ray get-auth-token
--generate`` (the commands of docs/gpusched.md, "Starting it on a real
cluster"). The fixture checks at the end that no process of the cluster is left.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import (
    gpusched,
    recording_file,
    records,
    run_processes,
    started_cluster,
    write_suite,
)

NODES = ({"GPUSCHED_SIMULATE_GPUS": "2"}, {"GPUSCHED_SIMULATE_GPUS": "1"})
RETRY_LINE = "gcs_client"  # Ray's C++ client: a line a second while a token is refused


@pytest.fixture(scope="module")
def token_cluster_shared():
    with started_cluster(NODES) as cluster:
        yield cluster


def test_run_finds_the_token_where_ray_does(token_cluster_shared, tmp_path):
    cluster = token_cluster_shared
    gpus = [2, 1, 1, 0]
    write_suite(
        tmp_path,
        {f"test_f{i}.py": recording_file(tmp_path, n, 1.0) for i, n in enumerate(gpus)},
    )
    result = gpusched(
        tmp_path, "run", ".", "--ray", cluster.address, "--json", "r.json", env=cluster.env()
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert result.stdout.splitlines()[-1] == "gpusched: 4 passed, 0 failed, 0 skipped", out
    assert "on 2 nodes" in result.stdout, out
    assert RETRY_LINE not in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert {entry["outcome"] for entry in report["files"]} == {"PASSED"}
    assert len({entry["node"] for entry in report["files"]}) == 2, report["files"]
    ran = records(tmp_path)
    assert len(ran) == len(gpus)
    run_id = ran[0]["tag"].split("-")[0]
    assert not run_processes(run_id)


def test_token_from_ray_auth_token_path(token_cluster_shared, tmp_path):
    """``plan`` (it connects and reads the nodes) with the token in a file named by the variable."""
    cluster = token_cluster_shared
    (tmp_path / "token").write_text(cluster.token)
    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    home = tmp_path / "home"  # no ~/.ray/auth_token there
    home.mkdir()
    env = cluster.env(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    result = gpusched(tmp_path, "plan", ".", "--ray", cluster.address, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "predicted schedule on 2 nodes" in result.stdout


@pytest.mark.parametrize(
    ("variables", "problem"),
    [
        ({}, "the cluster wants a token (token authentication) and none was found here: put"),
        (
            {"RAY_AUTH_TOKEN": "not-the-token"},
            "the cluster refuses the token from RAY_AUTH_TOKEN (not this cluster's?): put",
        ),
    ],
    ids=["missing", "wrong"],
)
def test_a_missing_or_wrong_token_is_one_line(token_cluster_shared, tmp_path, variables, problem):
    cluster = token_cluster_shared
    write_suite(tmp_path, {"test_a.py": "def test_a():\n    pass\n"})
    home = tmp_path / "home"
    home.mkdir()
    begin = time.monotonic()
    result = gpusched(
        tmp_path, "run", ".", "--ray", cluster.address, env=cluster.env(HOME=str(home), **variables)
    )
    took = time.monotonic() - begin
    assert result.returncode == 4, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gpusched: error: --ray {cluster.address}: {problem}"), lines
    assert "~/.ray/auth_token" in result.stderr and "RAY_AUTH_TOKEN_PATH" in result.stderr
    assert RETRY_LINE not in result.stdout + result.stderr
    assert result.stdout == ""
    assert took < 60, took  # no retries: collection and one call to the cluster


pytestmark = pytest.mark.filterwarnings("ignore")
