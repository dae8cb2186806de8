"""GRPO updates by the trainer and by TRL's ``GRPOTrainer`` on the same sampled batches.

``vs_trl.py --learn`` compares whole runs, in which each side samples its own
responses, so a difference in steps to 0.9 may be a difference in the update
or only a different draw. This script removes the draw. It samples the
batches once (``--steps`` batches of 16 prompts x 8 responses, HF
``generate`` from the initial model), gives those very tokens to both sides,
lets each take one optimizer step per batch with ``vs_trl.Shared``'s settings,
and compares what each did: the gradient just before every optimizer step
(after clipping; from the second step on it also carries any difference in the
optimizer's state) and the parameters after the last.

- trainer: the real path of ``python -m trainer``: ``PPOTrainer.train_step``
  (rewards, GRPO advantages, padding) driving an ``ActorRolloutRefWorker``
  in its own process (FSDP2 over a gloo group of one, as with
  ``trainer.num_workers=1``), whose sampling is replaced by the fixed batch;
- TRL: ``GRPOTrainer.train()``, with a ``rollout_func`` (TRL's hook for
  custom generation) that returns the fixed batches.

Each side runs in its own subprocess. Rows reach the two sides in different
orders, so sums run in different orders: equal updates agree to float
rounding (relative difference around 1e-6), not bit for bit.

    python bench/vs_trl_step.py                       # 663k-param Llama, 3 steps, seed 0
    python bench/vs_trl_step.py --seed 3 --steps 5
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


def shared(seed: int, steps: int):
    """The settings of ``vs_trl.py --learn``, for ``steps`` steps."""
    from vs_trl import Shared

    return Shared(
        prompts=PROMPTS,
        completions=COMPLETIONS,
        max_new_tokens=NEW_TOKENS,
        lr=1e-3,
        steps=steps,
        seed=seed,
    )


# --------------------------------------------------------------------------- the batch


def sample_batches(files: dict[str, Any], seed: int, steps: int) -> dict[str, list[list[int]]]:
    """``steps * COMPLETIONS`` raw samples (new tokens, EOS and padding kept) per training prompt.

    Every step uses each training prompt once (the file holds one batch of
    prompts), so each side takes the next ``COMPLETIONS`` samples of a prompt
    for each group of it: both see the same batches in the same step order.
    """
    from transformers import AutoModelForCausalLM

    from trainer.models import load_tokenizer

    tok = load_tokenizer(files["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(files["model_dir"], dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(files["train_file"]).read_text().splitlines()]
    texts = [r["prompt"] for _ in range(steps) for r in rows for _ in range(COMPLETIONS)]
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
    files: dict[str, Any], batch_path: Path, out_path: Path, seed: int, steps: int, extra: list[str]
) -> None:
    """``PPOTrainer.train_step`` on each fixed batch; saves gradients and parameters."""
    from vs_trl import trainer_overrides

    from trainer import fsdp
    from trainer.config import load_config
    from trainer.data.prompts import build_datasets
    from trainer.loop.ppo import PPOTrainer, resolve_reward_fn, response_length
    from trainer.models import load_tokenizer, resolve_model_path
    from trainer.rollout.base import finish_responses
    from trainer.workers import ActorRolloutRefWorker

    work = out_path.parent
    cfg = load_config(
        [*trainer_overrides(shared(seed, steps), files, str(work / "trainer-run")), *extra]
    )
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
    grads: list[dict[str, torch.Tensor]] = []

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    def snapshot_grads(*_: Any) -> None:
        grads.append({n: full(p.grad) for n, p in worker.actor.named_parameters()})

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
    rewards = [trainer.train_step()["rollout/reward_mean"] for _ in range(steps)]
    assert not any(fixed.values()), "every fixed response is used exactly once"
    params = fsdp.full_state_dict(worker.actor)
    torch.save({"grads": grads, "params": params, "rewards": rewards}, out_path)


# --------------------------------------------------------------------------- TRL side


def run_trl(
    files: dict[str, Any], batch_path: Path, out_path: Path, seed: int, steps: int, _: Any
) -> None:
    """``GRPOTrainer`` steps on the fixed batches (``rollout_func``); saves gradients and parameters."""
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
    grads: list[dict[str, torch.Tensor]] = []

    class SnapshotGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**trl_config(shared(seed, steps), str(out_path.parent / "trl-run"))),
        train_dataset=load_dataset("json", data_files=files["train_file"], split="train"),
        processing_class=tok,
        callbacks=[SnapshotGrads()],
        rollout_func=rollout_func,
    )
    trainer.train()
    assert not any(fixed.values()), "every fixed response is used exactly once"
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    per_step = len(rewards) // steps
    means = [sum(rewards[i : i + per_step]) / per_step for i in range(0, len(rewards), per_step)]
    torch.save({"grads": grads, "params": params, "rewards": means}, out_path)


# --------------------------------------------------------------------------- comparison


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius), 0 when both are 0."""
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


def compare(t: dict[str, Any], p: dict[str, Any], before: dict[str, torch.Tensor]) -> int:
    """Print per-step gradient and final parameter differences; 0 when they agree to rounding."""
    names = sorted(set(t["grads"][0]) & set(p["grads"][0]))
    missing = sorted(set(t["grads"][0]) ^ set(p["grads"][0]))
    if missing:
        print(f"parameters only one side has: {missing}")
    if len(t["grads"]) != len(p["grads"]):
        print(f"optimizer steps: trainer {len(t['grads'])}, TRL {len(p['grads'])}")
        return 1
    print(
        f"{'step':>4} | {'batch reward':>12} | {'grad norm (clipped)':>21} | "
        f"{'grad rel. diff':>14} | {'1 - cosine':>10}"
    )
    print(f"{'':>4} | {'(both)':>12} | {'trainer':>10} {'TRL':>10} |")
    ok = True
    for step, (gt, gp, rt, rp) in enumerate(
        zip(t["grads"], p["grads"], t["rewards"], p["rewards"], strict=True), 1
    ):
        ft = torch.cat([gt[n].flatten() for n in names]).double()
        fp = torch.cat([gp[n].flatten() for n in names]).double()
        g_rel = rel(ft, fp)
        cos = float(torch.nn.functional.cosine_similarity(ft, fp, dim=0))
        same_reward = abs(rt - rp) < 1e-9
        print(
            f"{step:>4} | {rt:12.6f}{'' if same_reward else f' vs {rp:.6f}'} | "
            f"{ft.norm():10.6f} {fp.norm():10.6f} | {g_rel:14.2e} | {1 - cos:10.2e}"
        )
        ok = ok and same_reward and g_rel < 1e-4
    dt = torch.cat([(t["params"][n] - before[n]).flatten() for n in names])
    dp = torch.cat([(p["params"][n] - before[n]).flatten() for n in names])
    d_rel = rel(dt, dp)
    print(
        f"\nparameter change after the last step (after - before): relative difference {d_rel:.2e}"
    )
    ok = ok and d_rel < 1e-3
    print("same updates (to float rounding)" if ok else "DIFFERENT UPDATES")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seed", type=int, default=0, help="sampling seed of the batch (and both sides')"
    )
    ap.add_argument("--learn-model", default="128,256,4", metavar="HIDDEN,INTERMEDIATE,LAYERS")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps, one fixed batch each")
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
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be >= 1")
    if args.side:  # a child: one side, in its own process
        work = Path(args.work)
        files = json.loads((work / "files.json").read_text())
        run = run_trainer if args.side == "trainer" else run_trl
        run(
            files,
            work / "batch.pt",
            work / f"{args.side}.pt",
            args.seed,
            args.steps,
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
        torch.save(sample_batches(files, args.seed, args.steps), work / "batch.pt")
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
            cmd = [sys.executable, __file__, "--side", side, "--work", d]
            cmd += ["--seed", str(args.seed), "--steps", str(args.steps)]
            cmd += [f"--trainer-override={o}" for o in args.trainer_override]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                raise SystemExit(f"vs_trl_step: the {side} side failed (rc {proc.returncode})")
        print(
            f"{args.steps} GRPO steps, each on its own batch of {PROMPTS} prompts x {COMPLETIONS} "
            f"responses sampled once (seed {args.seed}), {NEW_TOKENS} new tokens, model "
            f"{args.learn_model}, lr 1e-3, clip 1.0\n"
        )
        return compare(torch.load(work / "trainer.pt"), torch.load(work / "trl.pt"), before_params)


if __name__ == "__main__":
    sys.exit(main())
