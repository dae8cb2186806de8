"""Rank functions for tests/trainer/test_checkpoint_dcp.py (importable by spawned ranks).

Each runs on real gloo ranks of :func:`rl_e2e.distributed.run_distributed`
with the tiny model sharded by FSDP2 and AdamW (the trainer's optimizer).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from trainer import fsdp
from trainer.config import OptimConfig
from trainer.models import load_tokenizer
from trainer.workers.compute import PolicyUpdateSettings, compute_log_probs, update_policy
from trainer.workers.setup import build_actor, build_optimizer

SETTINGS = PolicyUpdateSettings(
    ppo_epochs=1, num_mini_batches=1, micro_batch_size=2, entropy_coeff=0.01, grad_clip=1.0
)
# Warm-up over 4 steps: the scheduler's state changes the next step's learning rate.
OPTIM = OptimConfig(lr=1e-2, warmup_steps=4)


def build(model_dir: str, strategy: str = "fsdp2") -> tuple[torch.nn.Module, Any, Any]:
    """Actor (sharded over the world for fsdp2, whole for ddp), AdamW and its scheduler."""
    torch.set_num_threads(1)
    model = build_actor(model_dir)
    if strategy == "fsdp2":
        model = fsdp.shard_model(model, torch.device("cpu"))
    opt, sched = build_optimizer(model, OPTIM)
    return model, opt, sched


def global_loss(model, rows: TensorDict) -> float:
    """PPO's clipped surrogate, token-mean over the whole batch (all ranks' rows): the loss
    the step is about to minimise. Each rank sums its rows; one all-reduce adds the ranks."""
    with fsdp.gathered_for_inference(model), torch.no_grad():
        lp, _ = compute_log_probs(model, rows, 1.0, 64)
    mask = rows["response_mask"].float()
    ratio = (lp - rows["old_log_probs"]).exp()
    adv = rows["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    total = torch.stack([(pg * mask).sum(), mask.sum()])
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1])


def step(model, opt, sched, td: TensorDict, rank: int, world: int) -> dict[str, float]:
    """One PPO update on this rank's rows of ``td`` (gradients averaged over the ranks).

    Returns rank 0's update metrics and ``loss``: :func:`global_loss` before the update.
    """
    rows = td.split(len(td) // world)[rank]
    loss = global_loss(model, rows)
    metrics = update_policy(model, opt, rows, SETTINGS)
    sched.step()
    return {"loss": loss, **metrics}


def greedy(model, tok, prompts: TensorDict) -> torch.Tensor:
    """Greedy responses (8 tokens) of ``model`` through the trainer's HF rollout engine."""
    from trainer.rollout import SamplingParams, build_engine

    engine = build_engine("hf", model, tok)
    with fsdp.gathered_for_inference(model):
        out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    return out["responses"]


def vllm_greedy(rank: int, world: int, model_dir: str, prompts: TensorDict) -> torch.Tensor:
    """Greedy responses of a vLLM engine that loaded ``model_dir`` from disk (CPU)."""
    from vllm_ranks import KV_CACHE

    from trainer.rollout import SamplingParams, build_engine

    tok = load_tokenizer(model_dir)
    engine = build_engine(
        "vllm",
        build_actor(model_dir),
        tok,
        model_path=model_dir,
        device=torch.device("cpu"),
        kv_cache_memory=KV_CACHE,
        seed=0,
    )
    try:
        return engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))[
            "responses"
        ]
    finally:
        engine.close()


def _clone(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _full(model, opt) -> tuple[dict, dict]:
    """Full model and optimizer state, copied: on CPU the gather may alias live tensors
    (AdamW's replicated ``step``), which later steps would change in place."""
    return _clone(fsdp.full_state_dict(model)), _clone(fsdp.full_optimizer_state_dict(model, opt))


def _kill_self(directory: Path, rank: int) -> None:
    """A write hook: this process dies by SIGKILL, as a preempted or OOM-killed rank would."""
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_rank1(directory: Path, rank: int) -> None:
    if rank == 1:
        raise OSError(f"no space left on device (test hook, {directory.name})")


def save_run(
    rank: int, world: int, model_dir: str, batches: list[TensorDict], prompts: TensorDict, out: str
) -> dict:
    """Train, save (sync), record the state; then an async save racing the next step; then
    :func:`ddp_roundtrip`'s save to ``out/ddp`` (the same 2 ranks, a model of its own);
    then a failing save."""
    from trainer.checkpoints.export import write_hf_files
    from trainer.workers.state import CheckpointSaver, CheckpointWriteError, set_write_hook

    model, opt, sched = build(model_dir)
    tok = load_tokenizer(model_dir)
    step(model, opt, sched, batches[0], rank, world)
    saver = CheckpointSaver("actor", rank)
    saver.save(Path(out) / "sync", model, opt, sched, extra=lambda d: write_hf_files(d, model, tok))
    saved_model, saved_optim = _full(model, opt)
    result: dict[str, Any] = {
        "model": saved_model,
        "optim": saved_optim,
        "sched": sched.state_dict(),
        "greedy": greedy(model, tok, prompts),
    }
    result["next"] = step(model, opt, sched, batches[1], rank, world)  # uninterrupted

    # Async: the write runs while the next update changes every parameter in place.
    at_save, _ = _full(model, opt)
    saver.save(Path(out) / "async", model, opt, sched, asynchronous=True)
    result["pending"] = saver.pending
    step(model, opt, sched, batches[2], rank, world)
    saver.wait()
    result["async_model"] = at_save
    result["moved_on"] = fsdp.full_state_dict(model)

    # The plain (ddp) strategy's save, here to spare a 2-rank start of its own: everything
    # recorded above is final, and the failing save below is the last collective work.
    result["ddp"] = ddp_roundtrip(rank, world, model_dir, str(Path(out) / "ddp"), False)

    # A background write that fails on rank 1: an error at wait, naming the checkpoint.
    set_write_hook(_fail_rank1)
    try:
        saver.save(Path(out) / "failing", model, opt, sched, asynchronous=True)
        saver.wait()
        result["failure"] = None
    except CheckpointWriteError as exc:
        result["failure"] = str(exc)
    finally:
        set_write_hook(None)
    return result if rank == 0 else {"failure": result["failure"], "pending": result["pending"]}


def resume_run(
    rank: int, world: int, model_dir: str, ckpt: str, batch: TensorDict, saved: dict
) -> dict:
    """Load the checkpoint on this world size; the next step, and the same step from today's
    full-state load (the saved state gathered in memory) as the reference."""
    from trainer.workers.state import load_training_state

    model, opt, sched = build(model_dir)
    load_training_state(ckpt, "actor", rank, model, opt, sched)
    loaded_model, loaded_optim = _full(model, opt)
    loaded_sched = sched.state_dict()
    resumed = step(model, opt, sched, batch, rank, world)

    ref, ref_opt, ref_sched = build(model_dir)
    # A copy: spawn shares argument tensors with the parent, and the optimizer adopts
    # AdamW's step tensors as they are, so the reference step would change the caller's.
    saved = _clone(saved)
    fsdp.load_full_state_dict(ref, saved["model"])
    fsdp.load_full_optimizer_state_dict(ref, ref_opt, saved["optim"])
    ref_sched.load_state_dict(saved["sched"])
    reference = step(ref, ref_opt, ref_sched, batch, rank, world)
    if rank != 0:
        return {}
    return {
        "model": loaded_model,
        "optim": loaded_optim,
        "sched": loaded_sched,
        "next": resumed,
        "reference": reference,
    }


def kill_run(rank: int, world: int, model_dir: str, run_dir: str, state_file: str) -> None:
    """Rank 0 is the driver: checkpoint 1 commits; during checkpoint 2 rank 1 is SIGKILLed.

    Before the second save rank 0 writes the full state of checkpoint 1 (a plain
    tensor file the test reads back with ``weights_only=True``) to compare with.
    """
    from trainer.checkpoints import store as ckpt
    from trainer.workers.state import CheckpointSaver, set_write_hook

    model, opt, sched = build(model_dir)
    saver = CheckpointSaver("actor", rank)

    def save_all(step_no: int) -> None:
        def save_workers(d: str) -> None:
            dist.broadcast_object_list([d], src=0)
            saver.save(d, model, opt, sched)

        if rank == 0:
            ckpt.save_checkpoint(
                run_dir, step_no, {"loader": {"epoch": 0, "position": step_no}}, save_workers
            )
        else:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            saver.save(box[0], model, opt, sched)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_all(1)
    full = fsdp.full_state_dict(model)
    if rank == 0:
        torch.save(full, state_file)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    if rank == 1:
        set_write_hook(_kill_self)
    save_all(2)
    raise AssertionError("unreachable: rank 1 was killed during the second save")


def ddp_roundtrip(rank: int, world: int, model_dir: str, ckpt: str, load: bool) -> dict:
    """The plain (ddp) strategy through the same DCP path: save on this world, or load."""
    from trainer.workers.state import CheckpointSaver, load_training_state

    model, opt, sched = build(model_dir, strategy="ddp")
    if load:
        load_training_state(ckpt, "actor", rank, model, opt, sched)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
        CheckpointSaver("actor", rank).save(ckpt, model, opt, sched)
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": opt.state_dict()["state"],
        "sched": sched.state_dict(),
    }
