"""Time to validation reward 0.9 with each rollout engine: ``python -m trainer`` with HF and vLLM.

For each seed, ``python -m trainer rollout.engine=hf`` and then
``rollout.engine=vllm``, in this one run, with ``trainer.stop_at_val_reward``
set: the same defaults otherwise (the embedded tiny model and task, 2 CPU
workers). Each run is a whole process, start-up included, as a user starts it;
the figures come from the process's wall clock and its ``metrics.jsonl``.

    python bench/engine_learning.py                       # seeds 0 1 2, the default job
    python bench/engine_learning.py --seeds 0 --extra algo=grpo
    python bench/engine_learning.py --extra rollout.multi_turn.enable=true data.task=lookup

Printed per seed and engine: steps to the target, process wall seconds, the
step the target was first seen, the last validation reward, and the mean
engine/actor probability gap (vLLM only); then the ratio vLLM / HF of wall
time per seed and over all seeds. One run per seed and engine is one draw:
the two engines sample different tokens from the same policy, so the step at
which a run crosses 0.9 differs by chance; the wall time per step is the
comparison that does not depend on that draw.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(engine: str, seed: int, target: float, extra: list[str], root: Path) -> dict:
    """One ``python -m trainer`` process; its wall time and what its metrics say."""
    run_dir = root / f"{engine}-{seed}"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        f"rollout.engine={engine}",
        f"seed={seed}",
        f"trainer.stop_at_val_reward={target}",
        f"trainer.run_dir={run_dir}",
        "trainer.tensorboard=false",
        "trainer.progress=false",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r]
    reached = next((step for step, v in vals if v >= target), None)
    gaps = [r["rollout/actor_prob_diff_mean"] for r in rows if "rollout/actor_prob_diff_mean" in r]
    steps = rows[-1]["step"]
    return {
        "engine": engine,
        "seed": seed,
        "reached": reached,
        "steps": steps,
        "wall": wall,
        "step_time": sum(r["timing/step"] for r in rows) / steps,
        "last_val": vals[-1][1] if vals else float("nan"),
        "gap": sum(gaps) / len(gaps) if gaps else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=0.9, help="validation reward to reach")
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--extra", nargs="*", default=[], help="more python -m trainer overrides")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="engine-learning-") as tmp:
        for seed in args.seeds:
            for engine in args.engines:
                r = run(engine, seed, args.target, args.extra, Path(tmp))
                results.append(r)
                print(
                    f"  seed {seed} {engine:4s}: reached {r['reached']} in {r['wall']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"python -m trainer {' '.join(args.extra)} trainer.stop_at_val_reward={args.target}")
    print(
        f"{'seed':>4} {'engine':>6} | {'steps to':>8} {'wall s':>7} {'s/step':>7} "
        f"{'step s':>7} {'last val':>8} {'|p gap|':>9}"
    )
    for r in results:
        reached = str(r["reached"]) if r["reached"] is not None else "-"
        gap = f"{r['gap']:.2e}" if r["gap"] is not None else "-"
        print(
            f"{r['seed']:>4} {r['engine']:>6} | {reached:>8} {r['wall']:>7.1f} "
            f"{r['wall'] / r['steps']:>7.3f} {r['step_time']:>7.3f} {r['last_val']:>8.3f} {gap:>9}"
        )
    if set(args.engines) == {"hf", "vllm"}:
        by = {(r["engine"], r["seed"]): r for r in results}
        ratios = [by["vllm", s]["wall"] / by["hf", s]["wall"] for s in args.seeds]
        steps = [by["vllm", s]["step_time"] / by["hf", s]["step_time"] for s in args.seeds]
        print("wall time to the target, vLLM / HF: " + ", ".join(f"{x:.2f}" for x in ratios))
        total = sum(by["vllm", s]["wall"] for s in args.seeds) / sum(
            by["hf", s]["wall"] for s in args.seeds
        )
        print(f"over all seeds: {total:.2f}")
        print("seconds per training step, vLLM / HF: " + ", ".join(f"{x:.2f}" for x in steps))


if __name__ == "__main__":
    main()
