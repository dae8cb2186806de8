"""Seconds per PPO iteration: the Ray trainer (2 workers) next to the single-process loop.

Both run the same configuration (model, batch, algorithm) in this one
process's run, one after the other: first the plain reference loop
(:mod:`trainer.reference_loop`, no Ray) with 1 and with N torch threads, then
the single-controller trainer with N Ray workers of 1 thread each. Warm-up
iterations are excluded; Ray start-up is reported on its own line. The ratio
trainer / best reference is the cost of the single controller.

    python bench/ppo_step.py                 # CPU, default config (GAE)
    python bench/ppo_step.py --algo grpo --iters 10
    python bench/ppo_step.py --device cuda   # needs CUDA; fails clearly without
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="gae", help="gae or grpo (default gae)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per setup")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--workers", type=int, default=2, help="Ray workers (and reference threads)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p.parse_known_args(argv)


def _time_steps(step, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/ppo_step.py: --device cuda needs a CUDA GPU; torch.cuda.is_available() is False here",
            file=sys.stderr,
        )
        return 2
    from trainer.config import load_config

    use_gpu = "true" if args.device == "cuda" else "false"
    cfg = load_config(
        [
            f"algo={args.algo}",
            f"trainer.num_workers={args.workers}",
            f"trainer.use_gpu={use_gpu}",
            "trainer.val_every=0",
            *overrides,
        ]
    )
    rows: list[tuple[str, float, float]] = []

    from trainer.reference_loop import ReferenceLoop

    for threads in sorted({1, args.workers}):
        torch.set_num_threads(threads)
        loop = ReferenceLoop(cfg)
        counter = iter(range(10**9))
        times = _time_steps(
            lambda loop=loop, counter=counter: loop.step(next(counter)), args.warmup, args.iters
        )
        rows.append(
            (
                f"reference loop, 1 process, {threads} thread(s)",
                statistics.median(times),
                statistics.stdev(times),
            )
        )
    torch.set_num_threads(1)

    import ray

    from trainer.data import build_datasets
    from trainer.models import load_tokenizer, resolve_model_path
    from trainer.ppo import (
        PPOTrainer,
        build_worker_groups,
        resolve_reward_fn,
        response_length,
        shutdown_worker_groups,
    )
    from trainer.runtime_env import get_runtime_env

    t0 = time.perf_counter()
    ray.init(
        num_cpus=args.workers,
        num_gpus=args.workers if args.device == "cuda" else 0,
        include_dashboard=False,
        runtime_env=get_runtime_env(),
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        path = resolve_model_path(cfg.model.path)
        tok = load_tokenizer(path)
        train, val = build_datasets(cfg, tok)
        max_new = response_length(cfg)
        groups = build_worker_groups(cfg, path, max_new)
        try:
            for g in groups.values():
                g.init_model()
            startup = time.perf_counter() - t0
            trainer = PPOTrainer(
                cfg,
                groups["actor"],
                groups.get("critic"),
                tok,
                train,
                val,
                resolve_reward_fn(cfg),
                max_new,
                args.workers,
            )
            times = _time_steps(trainer.train_step, args.warmup, args.iters)
            rows.append(
                (
                    f"trainer, {args.workers} Ray workers x 1 thread",
                    statistics.median(times),
                    statistics.stdev(times),
                )
            )
        finally:
            shutdown_worker_groups(groups)
    finally:
        ray.shutdown()

    best_ref = min(r[1] for r in rows[:-1])
    seqs = cfg.data.train_batch_size * cfg.rollout.n
    print(
        f"\nPPO iteration time: algo={cfg.algo}, {seqs} sequences/iteration, device={args.device}, "
        f"median of {args.iters} after {args.warmup} warm-up\n"
    )
    print(f"| {'setup':<42} | {'s/iter':>7} | {'stdev':>6} | {'vs best reference':>17} |")
    print(f"|{'-' * 44}|{'-' * 9}|{'-' * 8}|{'-' * 19}|")
    for name, med, sd in rows:
        print(f"| {name:<42} | {med:7.3f} | {sd:6.3f} | {med / best_ref:16.2f}x |")
    print(f"\ntrainer start-up (ray.init + workers + model load): {startup:.1f} s")
    print(f"single-controller overhead ratio: {rows[-1][1] / best_ref:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
