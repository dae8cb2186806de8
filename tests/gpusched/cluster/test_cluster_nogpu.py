"""A cluster without GPUs: GPU files are skipped with the reason, CPU files run; SIGTERM ends cleanly."""

from __future__ import annotations

import json
import signal
import time

import pytest
from deadlines import hang_guard

from conftest import (
    gpusched,
    ray_cluster,
    recording_file,
    run_processes,
    start_gpusched,
    started,
    write_suite,
)

NO_CARDS = {"CUDA_VISIBLE_DEVICES": ""}  # no card even on a machine that has some


@pytest.fixture(scope="module")
def cpu_cluster_shared():
    with ray_cluster([NO_CARDS, NO_CARDS]) as cluster:
        yield cluster


def test_gpu_files_are_skipped_and_cpu_files_run(cpu_cluster_shared, tmp_path):
    write_suite(
        tmp_path,
        {
            "test_gpu.py": "import pytest\n\n@pytest.mark.gpu(1)\ndef test_gpu():\n    pass\n",
            "test_cpu.py": recording_file(tmp_path, 0, 0.1),
        },
    )
    result = gpusched(tmp_path, "run", ".", "--ray", cpu_cluster_shared.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED     test_gpu.py (1 skipped) - needs 1 GPUs, no node of the cluster has any" in (
        result.stdout
    )
    assert result.stdout.splitlines()[-1] == "gpusched: 1 passed, 0 failed, 1 skipped"


def test_sigterm_kills_every_file_and_exits_2(cpu_cluster_shared, tmp_path):
    write_suite(
        tmp_path,
        {f"test_s{i}.py": recording_file(tmp_path, 0, 300, escapee=True) for i in range(3)},
    )
    proc = start_gpusched(
        tmp_path, "run", ".", "--ray", cpu_cluster_shared.address, "--json", "r.json"
    )
    try:
        deadline = time.monotonic() + hang_guard(60)
        while len(started(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        tags = started(tmp_path)
        assert len(tags) == 2, (tmp_path / "gpusched.out").read_text()  # one CPU slot per node
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=hang_guard(20))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "gpusched.out").read_text()
    assert code == 2, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert sorted(e["outcome"] for e in report["files"]) == [
        "INTERRUPTED",
        "INTERRUPTED",
        "NOT RUN",
    ]
    run_id = next(iter(tags)).split("-")[0]
    left = run_processes(run_id)
    assert not left, [(p.pid, p.name()) for p in left]
