"""Seconds per PPO iteration: the Ray trainer (2 workers) next to the single-process loop.

Both run the same configuration (model, batch, algorithm) in this one
process's run, one after the other: first the plain reference loop
(:mod:`trainer.loop.reference`, no Ray) with 1 and with N torch threads, then
the single-controller trainer with N Ray workers of 1 thread each. Warm-up
iterations are excluded; Ray start-up is reported on its own line. The ratio
trainer / best reference is the cost of the single controller.

    python bench/ppo_step.py                 # CPU, default config (GAE)
    python bench/ppo_step.py --algo grpo --iters 10
    python bench/ppo_step.py --device cuda   # needs CUDA; fails clearly without
    python bench/ppo_step.py --strategy ddp,fsdp2          # both training engines, one run
    python bench/ppo_step.py --device cuda --engine hf,vllm  # both rollout engines

Each trainer row also reports rollout tokens/s (response tokens / generation
time) and training tokens/s (sequence tokens / actor + critic update time).

    python bench/ppo_step.py --profile       # where a trainer step's time goes
    python bench/ppo_step.py --startup 3     # python -m trainer: command to first step
    python bench/ppo_step.py --startup 3 --baseline-repo /tmp/old   # and another checkout's, alternately

``--profile`` splits each trainer row's step (the means over the timed
iterations of ``timing/*`` and ``perf/*`` in ``metrics.jsonl``) into the
driver's own math, Ray call latency (waiting beyond the workers' compute:
scheduling, transfers, deserialization), serialization (splitting, submitting
and joining the batch), the workers' compute and, of it, host<->device copies,
with the tensor bytes the driver sent and received. ``--startup N`` runs
``python -m trainer trainer.total_steps=1`` N times and reports the seconds from
the command to the first step (the first row's write time minus its
``timing/step``), the same measure for any checkout; with ``--baseline-repo``
the runs alternate between the two checkouts, so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="gae", help="gae or grpo (default gae)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per setup")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--workers", type=int, default=2, help="Ray workers (and reference threads)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--strategy",
        default="auto",
        help="training engine(s), comma-separated: auto, fsdp2, ddp (default auto)",
    )
    p.add_argument(
        "--engine", default="hf", help="rollout engine(s), comma-separated: hf, vllm (default hf)"
    )
    p.add_argument(
        "--profile", action="store_true", help="print where each trainer row's step time goes"
    )
    p.add_argument(
        "--startup",
        type=int,
        default=0,
        metavar="N",
        help="only measure python -m trainer's start-up (command to first step), N runs",
    )
    p.add_argument(
        "--baseline-repo",
        default="",
        metavar="PATH",
        help="with --startup: also run another checkout's python -m trainer, alternately",
    )
    args, rest = p.parse_known_args(argv)
    args.strategies = _choices(p, "--strategy", args.strategy, ("auto", "fsdp2", "ddp"))
    args.engines = _choices(p, "--engine", args.engine, ("hf", "vllm"))
    return args, rest


def _choices(
    p: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]
) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        p.error(f"{flag} {value!r}: expected a comma-separated list of {', '.join(allowed)}")
    return items


def _throughput(metrics: list[dict[str, float]]) -> tuple[float, float]:
    """Rollout and training tokens per second over the timed iterations."""
    gen_tokens = sum(m["perf/response_tokens"] for m in metrics)
    gen_s = sum(m["timing/gen"] for m in metrics)
    train_tokens = gen_tokens * 1.0  # the update trains on exactly the sampled response tokens
    train_s = sum(
        m.get("timing/update_actor", 0) + m.get("timing/update_critic", 0) for m in metrics
    )
    return gen_tokens / max(gen_s, 1e-9), train_tokens / max(train_s, 1e-9)


def _time_steps(step, warmup: int, iters: int, results: list | None = None) -> list[float]:
    """Seconds per call after ``warmup`` calls; the timed calls' return values go to ``results``."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        r = step()
        out.append(time.perf_counter() - t0)
        if results is not None:
            results.append(r)
    return out


PROFILE_PARTS = (
    ("driver math", "timing/driver_math"),
    ("Ray call latency", "timing/call_latency"),
    ("serialization", "timing/serialize"),
    ("worker compute (less copies)", None),
    ("host<->device copies", "timing/copies"),
)


def _profile(label: str, metrics: list[dict[str, float]]) -> None:
    """Where the timed iterations' step time went, as means per step."""

    def mean(key: str) -> float:
        return statistics.fmean(m.get(key, 0.0) for m in metrics)

    step = mean("timing/step")
    print(f"\nprofile of {label}: {step:.3f} s/step (means over {len(metrics)} steps)")
    print(f"| {'part':<30} | {'s/step':>7} | {'share':>6} |")
    print(f"|{'-' * 32}|{'-' * 9}|{'-' * 8}|")
    for name, key in PROFILE_PARTS:
        secs = mean(key) if key else mean("timing/worker_compute") - mean("timing/copies")
        print(f"| {name:<30} | {secs:7.3f} | {secs / max(step, 1e-9):6.1%} |")
    controller = mean("timing/controller")
    print(
        f"| {'controller (latency + serial.)':<30} | {controller:7.3f} | {controller / step:6.1%} |"
    )
    print(
        f"driver bytes per step: {mean('perf/driver_bytes') / 1e6:.2f} MB "
        f"({mean('perf/driver_bytes_sent') / 1e6:.2f} sent, "
        f"{mean('perf/driver_bytes_received') / 1e6:.2f} received) in "
        f"{mean('perf/worker_calls'):.0f} calls; the batch: {mean('perf/batch_bytes') / 1e6:.2f} MB "
        f"({mean('perf/driver_bytes') / max(mean('perf/batch_bytes'), 1):.2f}x)"
    )


def _startup_once(repo: Path, overrides: list[str]) -> float:
    """``python -m trainer`` in ``repo``, one step: seconds from the command to that step's start."""
    run_dir = Path(tempfile.mkdtemp(prefix="su", dir="/tmp"))
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONPATH=str(repo))
    try:
        t0 = time.time()
        subprocess.run(
            [sys.executable, "-m", "trainer", "trainer.total_steps=1", "trainer.val_every=0",
             "trainer.export_final=false", "trainer.progress=false",
             f"trainer.run_dir={run_dir}", *overrides],
            cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        metrics = run_dir / "metrics.jsonl"
        row = json.loads(metrics.read_text().splitlines()[0])
        return metrics.stat().st_mtime - row["timing/step"] - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _startup(args: argparse.Namespace, overrides: list[str]) -> int:
    """``--startup N``: command-to-first-step seconds of this checkout (and a baseline's)."""
    repos = {"this checkout": REPO}
    if args.baseline_repo:
        baseline = Path(args.baseline_repo).resolve()
        if not (baseline / "trainer" / "__main__.py").is_file():
            print(f"bench/ppo_step.py: --baseline-repo {baseline}: no trainer/__main__.py there",
                  file=sys.stderr)  # fmt: skip
            return 2
        repos["baseline"] = baseline
    times: dict[str, list[float]] = {name: [] for name in repos}
    for _ in range(args.startup):
        for name, repo in repos.items():  # alternately: both see the same load
            times[name].append(_startup_once(repo, overrides))
    print(f"\npython -m trainer, command to first step, {args.startup} run(s) each:")
    for name, secs in times.items():
        runs = ", ".join(f"{t:.1f}" for t in secs)
        print(f"  {name}: median {statistics.median(secs):.1f} s ({runs}) [{repos[name]}]")
    if "baseline" in times:
        ratio = statistics.median(times["this checkout"]) / statistics.median(times["baseline"])
        print(f"  this checkout / baseline: {ratio:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    if args.startup:
        return _startup(args, overrides)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/ppo_step.py: --device cuda needs a CUDA GPU; torch.cuda.is_available() is False here",
            file=sys.stderr,
        )
        return 2
    if "vllm" in args.engines and args.device != "cuda":
        print("bench/ppo_step.py: --engine vllm needs --device cuda", file=sys.stderr)
        return 2
    from trainer.config import load_config

    use_gpu = "true" if args.device == "cuda" else "false"
    base_overrides = [
        f"algo={args.algo}",
        f"trainer.num_workers={args.workers}",
        f"trainer.use_gpu={use_gpu}",
        "trainer.val_every=0",
        *overrides,
    ]
    cfg = load_config(base_overrides)
    rows: list[tuple[str, float, float]] = []

    from trainer.loop.reference import ReferenceLoop

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

    from trainer.data.prompts import build_datasets
    from trainer.launch.runtime_env import get_runtime_env
    from trainer.loop.ppo import (
        PPOTrainer,
        build_worker_groups,
        resolve_reward_fn,
        response_length,
        shutdown_worker_groups,
    )
    from trainer.models import load_tokenizer, resolve_model_path

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=args.workers,
        num_gpus=args.workers if args.device == "cuda" else 0,
        include_dashboard=False,
        runtime_env=get_runtime_env(),
        log_to_driver=False,
        logging_level="ERROR",
    )
    n_ref = len(rows)
    throughput: dict[str, tuple[float, float]] = {}
    step_metrics: dict[str, list[dict[str, float]]] = {}
    startup = {}
    try:
        path = resolve_model_path(cfg.model.path)
        tok = load_tokenizer(path)
        train, val = build_datasets(cfg, tok)
        max_new = response_length(cfg)
        for engine in args.engines:
            for strategy in args.strategies:
                run_cfg = load_config(
                    [
                        *base_overrides,
                        f"actor.strategy={strategy}",
                        f"critic.strategy={strategy}",
                        f"rollout.engine={engine}",
                    ]
                )
                t1 = time.perf_counter()
                groups = build_worker_groups(run_cfg, path, max_new)
                try:
                    for g in groups.values():
                        g.init_model()
                    label = f"trainer, {args.workers} workers, {strategy}, {engine}"
                    startup[label] = time.perf_counter() - (t0 if not startup else t1)
                    trainer = PPOTrainer(
                        run_cfg,
                        groups["actor"],
                        groups.get("critic"),
                        tok,
                        train,
                        val,
                        resolve_reward_fn(run_cfg),
                        max_new,
                        args.workers,
                    )
                    metrics: list[dict[str, float]] = []
                    times = _time_steps(trainer.train_step, args.warmup, args.iters, metrics)
                    rows.append((label, statistics.median(times), statistics.stdev(times)))
                    throughput[label] = _throughput(metrics)
                    step_metrics[label] = metrics
                finally:
                    shutdown_worker_groups(groups)
    finally:
        ray.shutdown()

    best_ref = min(r[1] for r in rows[:n_ref])
    seqs = cfg.data.train_batch_size * cfg.rollout.n
    print(
        f"\nPPO iteration time: algo={cfg.algo}, {seqs} sequences/iteration, device={args.device}, "
        f"median of {args.iters} after {args.warmup} warm-up\n"
    )
    head = f"| {'setup':<42} | {'s/iter':>7} | {'stdev':>6} | {'vs best reference':>17} |"
    print(head + " rollout tok/s | update tok/s |")
    print(f"|{'-' * 44}|{'-' * 9}|{'-' * 8}|{'-' * 19}|{'-' * 15}|{'-' * 14}|")
    for name, med, sd in rows:
        gen, upd = throughput.get(name, (None, None))
        cells = " | ".join(
            f"{'-' if v is None else f'{v:.0f}':>{w}}" for v, w in ((gen, 13), (upd, 12))
        )
        print(f"| {name:<42} | {med:7.3f} | {sd:6.3f} | {med / best_ref:16.2f}x | {cells} |")
    print()
    for label, secs in startup.items():
        print(f"start-up of {label}: {secs:.1f} s (the first includes ray.init)")
    trainer_rows = rows[n_ref:]
    fastest = min(r[1] for r in trainer_rows)
    print(f"single-controller overhead ratio: {fastest / best_ref:.2f}x (target <= 1.2x on CPU)")
    if len(trainer_rows) > 1:
        base = trainer_rows[0]
        for name, med, _ in trainer_rows[1:]:
            print(f"{name} vs {base[0]}: {med / base[1]:.2f}x s/iter")
    if args.profile:
        for label, metrics in step_metrics.items():
            _profile(label, metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
