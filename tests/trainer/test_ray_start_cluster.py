"""Acceptance: ``python -m trainer`` joins clusters started as users start them.

Two raylets on this machine, ``ray start --head`` and ``ray start --address``
(one CPU each), with token authentication on (the token in the cluster's
``~/.ray/auth_token``, as ``ray get-auth-token --generate`` writes it) and
without. The clusters come from the helpers gpusched's cluster tests use
(``tests/gpusched/cluster/conftest.py``: its own short ``HOME`` and temp dir
per cluster, removed at the end, which also checks that no process of the
cluster is left).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from deadlines import hang_guard

REPO = Path(__file__).resolve().parents[2]
RETRY_LINE = "gcs_client"  # Ray's C++ client: a line a second while it is refused


def _cluster_helpers():
    """gpusched's cluster-test helpers, loaded by path (a conftest is not importable by name here)."""
    path = REPO / "tests" / "gpusched" / "cluster" / "conftest.py"
    spec = importlib.util.spec_from_file_location("gpusched_cluster_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


helpers = _cluster_helpers()
TWO_NODES = ({}, {})
TINY = (
    "algo=grpo",
    "trainer.num_workers=2",
    "trainer.nnodes=2",
    "trainer.val_every=0",
    "trainer.export_final=false",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "rollout.n=2",
    "data.num_train_examples=16",
    "data.num_val_examples=4",
)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's ``TRAINER_CACHE``: the first run that trains builds the tiny model in it
    (``ensure_tiny_model``, in a process that imports torch anyway), the others find it.
    Built here it cost this process the import of torch and transformers (5 core-s)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def token_cluster_shared():
    with helpers.started_cluster(TWO_NODES) as cluster:
        yield cluster


def trainer(cluster, cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m trainer ARGS`` on a machine of the cluster's user, ``RAY_ADDRESS`` = the head."""
    variables = cluster.env(
        RAY_ADDRESS=cluster.address, TRAINER_CACHE=str(cache), PYTHONPATH=str(REPO), **env
    )
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        env=variables,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_guard(300),
    )


def worker_hosts(cluster) -> list[psutil.Process]:
    """The cluster's processes that host trainer workers (Ray titles them after the actor class)."""
    found = []
    for proc in cluster.processes():
        try:
            if "WorkerHost" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_for_no_worker_hosts(cluster) -> list[psutil.Process]:
    """The run's worker processes still alive once Ray has had time to reap them (none, we expect)."""
    deadline = time.monotonic() + hang_guard(30)
    left = worker_hosts(cluster)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = worker_hosts(cluster)
    return left


def test_a_run_on_two_nodes_saves_and_resumes_with_the_clusters_token(
    token_cluster_shared, model_cache, tmp_path
):
    cluster = token_cluster_shared
    run_dir = tmp_path / "run"
    first = trainer(
        cluster,
        model_cache,
        *TINY,
        "trainer.total_steps=2",
        "trainer.save_every=2",
        f"trainer.run_dir={run_dir}",
    )
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert RETRY_LINE not in out
    assert re.search(
        rf"^trainer: joined the Ray cluster at {re.escape(cluster.address)}: 2 worker "
        r"process\(es\) on 2 node\(s\)$",
        first.stdout,
        re.M,
    ), out
    assert (run_dir / "checkpoints").is_dir(), sorted(p.name for p in run_dir.iterdir())
    assert not wait_for_no_worker_hosts(cluster)

    resumed = trainer(
        cluster,
        model_cache,
        *TINY,
        "trainer.total_steps=3",
        "trainer.resume=auto",
        f"trainer.run_dir={run_dir}",
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert re.search(r"^trainer: resumed from .+ at step 2$", resumed.stdout, re.M), out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not wait_for_no_worker_hosts(cluster)


@pytest.mark.parametrize(
    ("variables", "problem"),
    [
        ({}, "the cluster wants a token (token authentication) and none was found here: put"),
        (
            {"RAY_AUTH_TOKEN": "not-the-token"},
            "the cluster refuses the token from RAY_AUTH_TOKEN (not this cluster's?): put",
        ),
    ],
    ids=["no-token", "wrong-token"],
)
def test_a_missing_or_wrong_token_is_one_line_and_a_configuration_error(
    token_cluster_shared, model_cache, tmp_path, variables, problem
):
    cluster = token_cluster_shared
    home = tmp_path / "home"  # no ~/.ray/auth_token here
    home.mkdir()
    result = trainer(
        cluster,
        model_cache,
        *TINY,
        f"trainer.run_dir={tmp_path / 'r'}",
        HOME=str(home),
        **variables,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"trainer: error: RAY_ADDRESS={cluster.address}: {problem}")
    assert RETRY_LINE not in result.stdout + result.stderr
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_nothing_at_the_address_is_one_line(model_cache, tmp_path):
    port = helpers.free_port()  # bound and closed: nothing listens there
    cluster = helpers.StartedCluster(f"127.0.0.1:{port}", tmp_path, None)
    result = trainer(cluster, model_cache, *TINY, f"trainer.run_dir={tmp_path / 'r'}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"trainer: error: RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answers at 127.0.0.1:{port}"
    ), result.stderr


def test_a_cluster_without_token_authentication_is_joined_as_it_is(model_cache, tmp_path):
    with helpers.started_cluster(TWO_NODES, token=False) as cluster:
        run_dir = tmp_path / "run"
        result = trainer(
            cluster, model_cache, *TINY, "trainer.total_steps=1", f"trainer.run_dir={run_dir}"
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, out
        assert "2 worker process(es) on 2 node(s)" in result.stdout, out
        assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1
        assert not wait_for_no_worker_hosts(cluster)
