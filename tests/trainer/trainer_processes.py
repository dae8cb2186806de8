"""``python -m trainer`` as a process of its own that a test interrupts or kills, and its leftovers.

Every process of the run (the driver, Ray's, the workers') carries the
variable :data:`TAG` (``TRAINER_*`` variables reach the Ray workers), so a
test finds them all, during the run and after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil
from deadlines import hang_guard, wait_until

from gpusched.execution.proctree import processes_with
from trainer.models import ensure_tiny_model

TAG = "TRAINER_TEST_RUN_TAG"


def tagged(tag: str) -> list[psutil.Process]:
    """The processes carrying ``TAG=tag`` now."""
    return processes_with(TAG, tag)


def assert_all_gone(tag: str, seen: Sequence[psutil.Process]) -> None:
    """Every process of the run (seen during it, or carrying its tag now) exits within 30 s."""
    procs = {p.pid: p for p in [*seen, *tagged(tag)]}
    _, alive = psutil.wait_procs(list(procs.values()), timeout=hang_guard(30))
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes of the run still alive: {[(p.pid, p.cmdline()) for p in alive]}"


@contextmanager
def trainer_process(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``(driver, tag)``: ``python -m trainer *args`` started in a session of its own.

    The tiny model is built under ``tmp_path`` first. On exit the driver's
    process group is killed if it still runs, and Ray's temporary directory goes.
    """
    tag = uuid.uuid4().hex
    cache = tmp_path / "cache"
    ensure_tiny_model(cache_dir=cache)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray socket paths must stay short
    env.update({TAG: tag, "TRAINER_CACHE": str(cache), "RAY_TMPDIR": ray_tmp})
    driver = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield driver, tag
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def output_of_ended(driver: subprocess.Popen) -> str:
    """The output of a driver that has ended; the same text to every caller (the module
    fixtures share one driver between tests, and a pipe can be read to its end once)."""
    if not hasattr(driver, "ended_output"):
        driver.ended_output = driver.communicate()[0]
    return driver.ended_output


def wait_for_first_step(driver: subprocess.Popen, run_dir: Path) -> None:
    """Until the run has logged a step; fails with the driver's output if it ended first."""
    metrics = run_dir / "metrics.jsonl"
    wait_until(
        lambda: driver.poll() is not None or (metrics.exists() and metrics.read_text().strip()),
        300,
        "the first step",
    )
    assert driver.poll() is None, output_of_ended(driver)
