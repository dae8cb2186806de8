"""One GRPO update by the trainer and by TRL's ``GRPOTrainer`` on the same sampled batch.

``vs_trl.py --learn`` compares whole runs, in which each side samples its own
responses, so a difference in steps to 0.9 may be a difference in the update
or only a different draw. This script removes the draw. It samples one batch
once (16 prompts x 8 responses with HF ``generate``), gives those very tokens
to both sides, lets each take one optimizer step with ``vs_trl.Shared``'s
settings, and compares what each did: the gradient just before the optimizer
step (after clipping) and the parameters after it.

- trainer: the real path of ``python -m trainer``: ``PPOTrainer.train_step``
  (rewards, GRPO advantages, padding) driving an ``ActorRolloutRefWorker``
  in its own process (FSDP2 over a gloo group of one, as with
  ``trainer.num_workers=1``), whose sampling is replaced by the fixed batch;
- TRL: ``GRPOTrainer.train()`` for one step, with a ``rollout_func`` (TRL's
  hook for custom generation) that returns the fixed batch.

Each side runs in its own subprocess. Rows reach the two sides in different
orders, so sums run in different orders: equal updates agree to float
rounding (relative difference around 1e-6), not bit for bit.

    python bench/vs_trl_step.py                       # 663k-param Llama, seed 0
    python bench/vs_trl_step.py --seed 3 --learn-model 128,256,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PROMPTS, COMPLETIONS, NEW_TOKENS = 16, 8, 8


def shared(seed: int):
    """The settings of ``vs_trl.py --learn``, for one step."""
    from vs_trl import Shared

    return Shared(
        prompts=PROMPTS,
        completions=COMPLETIONS,
        max_new_tokens=NEW_TOKENS,
        lr=1e-3,
        steps=1,
        seed=seed,
    )


# --------------------------------------------------------------------------- the batch


def sample_batch(files: dict[str, Any], seed: int) -> dict[str, list[list[int]]]:
    """``COMPLETIONS`` raw samples (new tokens, EOS and padding kept) per training prompt."""
    from transformers import AutoModelForCausalLM

    from trainer.models import load_tokenizer

    tok = load_tokenizer(files["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(files["model_dir"], dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(files["train_file"]).read_text().splitlines()]
    texts = [r["prompt"] for r in rows for _ in range(COMPLETIONS)]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    batch: dict[str, list[list[int]]] = {}
    for text, ids in zip(texts, new, strict=True):
        batch.setdefault(text, []).append(ids)
    return batch


def cut_after_eos(ids: list[int], eos: int) -> list[int]:
    """The response as TRL keeps it: up to and including the first EOS."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


# --------------------------------------------------------------------------- trainer side


def run_trainer(
    files: dict[str, Any], batch_path: Path, out_path: Path, seed: int, extra: list[str]
) -> None:
    """One ``PPOTrainer.train_step`` on the fixed batch; saves gradients and parameters."""
    from vs_trl import trainer_overrides

    from trainer.config import load_config
    from trainer.data import build_datasets
    from trainer.models import load_tokenizer, resolve_model_path
    from trainer.ppo import PPOTrainer, resolve_reward_fn, response_length
    from trainer.rollout.base import finish_responses
    from trainer.workers import ActorRolloutRefWorker, fsdp

    work = out_path.parent
    cfg = load_config([*trainer_overrides(shared(seed), files, str(work / "trainer-run")), *extra])
    torch.manual_seed(cfg.seed)
    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    train, val = build_datasets(cfg, tok)
    max_new = response_length(cfg)
    worker = ActorRolloutRefWorker(cfg, path, max_new)
    worker.init_model()
    fixed = {
        tuple(tok(text)["input_ids"]): [list(r) for r in rows]
        for text, rows in torch.load(batch_path).items()
    }
    grads: dict[str, torch.Tensor] = {}

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    def snapshot_grads(*_: Any) -> None:
        grads.update({n: full(p.grad) for n, p in worker.actor.named_parameters()})

    worker.optimizer.register_step_pre_hook(snapshot_grads)

    class FixedBatchActor:
        """The worker, with its sampling replaced by the fixed batch (same layout as the HF engine)."""

        def generate_sequences(self, prompts, validation: bool = False):
            ids, mask = prompts["input_ids"], prompts["attention_mask"]
            rows = [
                fixed[tuple(i[m.bool()].tolist())].pop(0) for i, m in zip(ids, mask, strict=True)
            ]
            return finish_responses(
                ids, mask, torch.tensor(rows), max_new, tok.eos_token_id, tok.pad_token_id
            )

        def update_actor(self, batch, step: int):
            return [worker.update_actor(batch, step)]

    trainer = PPOTrainer(
        cfg, FixedBatchActor(), None, tok, train, val, resolve_reward_fn(cfg), max_new, 1
    )
    metrics = trainer.train_step()
    assert not any(fixed.values()), "every fixed response is used exactly once"
    params = fsdp.full_state_dict(worker.actor)
    torch.save(
        {"grads": grads, "params": params, "reward_mean": metrics["rollout/reward_mean"]},
        out_path,
    )


# --------------------------------------------------------------------------- TRL side


def run_trl(files: dict[str, Any], batch_path: Path, out_path: Path, seed: int, _: Any) -> None:
    """One ``GRPOTrainer`` step on the fixed batch (``rollout_func``); saves gradients and parameters."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer
    from trl_peer import _load_reward, make_reward
    from vs_trl import trl_config

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(files["model_dir"], local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        files["model_dir"], dtype=torch.float32, local_files_only=True
    )
    fixed = {text: list(rows) for text, rows in torch.load(batch_path).items()}
    rewards: list[float] = []

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        return {
            "prompt_ids": [tok(p)["input_ids"] for p in prompts],
            "completion_ids": [cut_after_eos(fixed[p].pop(0), tok.eos_token_id) for p in prompts],
            "logprobs": None,
        }

    base = make_reward(_load_reward(files["reward_file"], "score"), tok, True)

    def reward(prompts, completions, completion_ids, ground_truth, **kw) -> list[float]:
        out = base(prompts, completions, completion_ids, ground_truth, **kw)
        rewards.extend(out)
        return out

    reward.__name__ = "shared_reward"
    grads: dict[str, torch.Tensor] = {}

    class SnapshotGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**trl_config(shared(seed), str(out_path.parent / "trl-run"))),
        train_dataset=load_dataset("json", data_files=files["train_file"], split="train"),
        processing_class=tok,
        callbacks=[SnapshotGrads()],
        rollout_func=rollout_func,
    )
    trainer.train()
    assert not any(fixed.values()), "every fixed response is used exactly once"
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    torch.save(
        {"grads": grads, "params": params, "reward_mean": sum(rewards) / len(rewards)}, out_path
    )


# --------------------------------------------------------------------------- comparison


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius), 0 when both are 0."""
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


def compare(t: dict[str, Any], p: dict[str, Any], before: dict[str, torch.Tensor]) -> int:
    """Print the per-tensor and overall differences; 0 when the two steps agree to rounding."""
    names = sorted(set(t["grads"]) & set(p["grads"]))
    missing = sorted(set(t["grads"]) ^ set(p["grads"]))
    if missing:
        print(f"parameters only one side has: {missing}")
    flat = {
        k: torch.cat([d[n].flatten() for n in names]).double()
        for k, d in (("t", t["grads"]), ("p", p["grads"]))
    }
    dt = torch.cat([(t["params"][n] - before[n]).flatten() for n in names])
    dp = torch.cat([(p["params"][n] - before[n]).flatten() for n in names])
    g_rel, d_rel = rel(flat["t"], flat["p"]), rel(dt, dp)
    worst = max(names, key=lambda n: rel(t["grads"][n], p["grads"][n]))
    cos = float(torch.nn.functional.cosine_similarity(flat["t"], flat["p"], dim=0))
    print(
        f"mean reward of the batch        trainer {t['reward_mean']:.6f}   TRL {p['reward_mean']:.6f}"
    )
    print(
        f"gradient norm (after clipping)  trainer {flat['t'].norm():.6f}   TRL {flat['p'].norm():.6f}"
    )
    print(f"gradient: relative difference {g_rel:.2e}, 1 - cosine {1 - cos:.2e}")
    print(f"  worst tensor {worst}: {rel(t['grads'][worst], p['grads'][worst]):.2e}")
    print(f"parameter change (after - before): relative difference {d_rel:.2e}")
    ok = g_rel < 1e-4 and d_rel < 1e-3 and abs(t["reward_mean"] - p["reward_mean"]) < 1e-9
    print("same update (to float rounding)" if ok else "DIFFERENT UPDATES")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seed", type=int, default=0, help="sampling seed of the batch (and both sides')"
    )
    ap.add_argument("--learn-model", default="128,256,4", metavar="HIDDEN,INTERMEDIATE,LAYERS")
    ap.add_argument(
        "--trainer-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra python -m trainer override for the trainer side (repeatable), e.g. "
        "algorithm.grpo_std_eps=1e-6 (its default; vs_trl's equal settings use TRL's 1e-4)",
    )
    ap.add_argument("--side", choices=["trainer", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:  # a child: one side, in its own process
        work = Path(args.work)
        files = json.loads((work / "files.json").read_text())
        run = run_trainer if args.side == "trainer" else run_trl
        run(
            files,
            work / "batch.pt",
            work / f"{args.side}.pt",
            args.seed,
            args.trainer_override,
        )
        return 0

    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit(
            "vs_trl_step: TRL is not installed; it is an optional extra: pip install -e '.[peer]'"
        ) from None
    from vs_trl import ModelShape, build_assets

    hidden, inter, layers = (int(x) for x in args.learn_model.split(","))
    with tempfile.TemporaryDirectory(prefix="vs_trl_step-") as d:
        work = Path(d)
        files = build_assets(
            work, ModelShape("llama", hidden, inter, layers, 4, 4), PROMPTS, 4, NEW_TOKENS
        )
        files = {k: (str(v) if isinstance(v, Path) else v) for k, v in files.items()}
        (work / "files.json").write_text(json.dumps(files))
        torch.save(sample_batch(files, args.seed), work / "batch.pt")
        from transformers import AutoModelForCausalLM

        before = AutoModelForCausalLM.from_pretrained(files["model_dir"], dtype=torch.float32)
        before_params = {n: p.detach().clone() for n, p in before.state_dict().items()}
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        for side in ("trainer", "trl"):
            cmd = [sys.executable, __file__, "--side", side, "--work", d, "--seed", str(args.seed)]
            cmd += [f"--trainer-override={o}" for o in args.trainer_override]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                raise SystemExit(f"vs_trl_step: the {side} side failed (rc {proc.returncode})")
        print(
            f"one GRPO step, {PROMPTS} prompts x {COMPLETIONS} responses sampled once (seed "
            f"{args.seed}), {NEW_TOKENS} new tokens, model {args.learn_model}, lr 1e-3, clip 1.0\n"
        )
        return compare(torch.load(work / "trainer.pt"), torch.load(work / "trl.pt"), before_params)


if __name__ == "__main__":
    sys.exit(main())
