"""Devices and backends follow what Ray granted, not what CUDA shows.

On a GPU node a CPU Ray cluster used to break the trainer twice: the driver
saw CUDA and asked Ray for GPU bundles the cluster did not have, and workers
whose bundles held no GPU saw CUDA too and chose NCCL. This module recreates
that node: ``torch.cuda.is_available`` answers True in the driver
(monkeypatched) and in every worker (through the production worker setup
hook, ``TRAINER_EXTRA_WORKER_SETUP_HOOK``), on a cluster with no GPU. With a
CPU build of torch the hook makes ``is_available`` say True; on a GPU node it
shows the worker the real cards that Ray hid. A worker that believed CUDA
would choose NCCL and ``cuda:0``: the tests check the device and backend each
worker chose, and that a whole run trains on the CPU cluster.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from gpusched.inventory import nvml_cards
from trainer.__main__ import run_on_cluster
from trainer.config import load_config
from trainer.controller import (
    Dispatch,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    create_role_groups,
)
from trainer.workers.device import worker_device

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.skipif(
    torch.version.cuda is not None and not nvml_cards()[0],
    reason="a CUDA build of torch on a machine without cards: a worker can neither see a "
    "real card nor pretend to see one (CUDA calls would fail)",
)

HOOK = '''\
import os


def pretend_cuda():
    """Make this worker see CUDA (as on a GPU node) and record that it ran.

    With a CUDA build the machine's real cards are shown (Ray hid them from a
    worker granted none); with a CPU build ``is_available`` is made to say True.
    """
    import torch

    if torch.version.cuda is not None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        torch.cuda.is_available = lambda: True
    with open(os.path.join(os.path.dirname(__file__), "patched_pids"), "a") as f:
        f.write(f"{os.getpid()}\\n")
'''


@pytest.fixture(scope="module")
def hook_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hook") as d:
        (Path(d) / "fake_cuda.py").write_text(HOOK)
        yield Path(d)


@pytest.fixture(scope="module")
def e2e_ray_host_env(hook_dir: Path) -> dict[str, str]:
    return {"TRAINER_EXTRA_WORKER_SETUP_HOOK": f"{hook_dir / 'fake_cuda.py'}:pretend_cuda"}


@pytest.fixture
def driver_sees_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _patched_pids(hook_dir: Path) -> set[int]:
    path = hook_dir / "patched_pids"
    return {int(x) for x in path.read_text().split()} if path.exists() else set()


class Probe(Worker):
    dispatch = {"report": Dispatch.ONE_TO_ALL}

    def report(self) -> tuple[bool, str, str, int]:
        self.init_distributed()  # the default backend: chosen from Ray's grant
        return (
            torch.cuda.is_available(),
            str(worker_device("auto")),
            dist.get_backend(),
            os.getpid(),
        )


def test_workers_without_a_gpu_grant_use_cpu_and_gloo_though_cuda_is_visible(
    e2e_ray, hook_dir: Path
) -> None:
    manager = ResourcePoolManager({"p": ResourcePool([2])}, {"probe": "p"})
    groups = create_role_groups(manager, {"probe": (Probe, {})})
    try:
        reports = groups["probe"].report()
    finally:
        groups["probe"].shutdown()
        groups["probe"].pool.release()
    assert [r[:3] for r in reports] == [(True, "cpu", "gloo")] * 2
    assert {r[3] for r in reports} <= _patched_pids(hook_dir)


def test_auto_trains_on_a_cpu_cluster_though_the_driver_and_workers_see_cuda(
    e2e_ray, hook_dir: Path, tmp_path: Path, driver_sees_cuda: None
) -> None:
    assert torch.cuda.is_available()  # what the driver of a GPU node sees
    cfg = load_config(
        [
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "data.train_batch_size=16",
            "actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8",
            "rollout.n=2",
            "trainer.progress=false",
            "trainer.tensorboard=false",
            f"trainer.run_dir={tmp_path}",
        ]
    )
    assert cfg.trainer.device == "auto" and cfg.trainer.num_workers == 0
    result = run_on_cluster(cfg)
    # The cluster offers no GPU, so auto planned CPU workers: two of them by default.
    assert (cfg.trainer.use_gpu, cfg.trainer.num_workers) == (False, 2)
    assert len(result.history) == 2
    assert all(math.isfinite(m["actor/pg_loss"]) for m in result.history)
    assert set(result.worker_pids["actor"]) <= _patched_pids(hook_dir)
