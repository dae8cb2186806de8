"""Item 8 on a real card: NVML sees a process's memory, and its release after the process exits.

In a file of its own: gpusched schedules a file by its largest requirement, so
this GPU test would otherwise hold the CPU tests of test_faults_release.py back.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from gpusched.execution.release import NvmlRelease


@pytest.mark.gpu1
@pytest.mark.timeout(120)
def test_pynvml_sees_a_real_process_and_its_release():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; torch.cuda.is_available() is false")
    from gpusched.execution.release import PynvmlLayer

    card = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if not card.isdigit():
        pytest.skip(f"CUDA_VISIBLE_DEVICES={card!r} is not an NVML index")
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; x = torch.empty(2 * 10**9, dtype=torch.uint8, device='cuda');"
            " torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    with PynvmlLayer() as layer:
        try:
            assert hog.stdout.readline().strip() == "ready"
            assert hog.pid in layer.processes(card) or not layer.processes(card)  # container pids
            assert layer.used_memory(card) >= 2 * 10**9
            releaser = NvmlRelease(layer, timeout=0.0, threshold=10**9)
            assert asyncio.run(releaser.release((card,), frozenset({hog.pid}))) == [card]
        finally:
            hog.stdin.close()
            hog.wait(60)
        releaser = NvmlRelease(layer, timeout=30.0, threshold=10**9)
        assert asyncio.run(releaser.release((card,), frozenset({hog.pid}))) == []
