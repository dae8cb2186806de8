"""Steps per second of asynchronous RL (staleness k = 1) next to k = 0 and the colocated trainer.

Two jobs, three setups each, side by side in this one run on one local Ray
cluster (every setup a whole trainer run through
:func:`trainer.__main__.run_on_cluster`, one after another):

* ``colocated``: the synchronous trainer as ``python -m trainer`` runs it:
  ``trainer.num_workers=2``, generation in the actor's workers (two
  processes, like the pools below);
* ``k=0 pool``: ``rollout.workers=1 trainer.num_workers=1``: one trainer
  process, one rollout process, the synchronous schedule (each batch drawn
  after the previous update's weights were pushed);
* ``k=1 pool``: ``rollout.staleness=1 trainer.num_workers=1``: the same two
  processes, the rollout worker generating the next batch while the trainer
  trains on this one.

Jobs: ``default`` (``python -m trainer``'s: repeat task, PPO with GAE) and
``tool`` (the multi-turn ``lookup`` task whose tool is
:class:`~trainer.rollout.tools.remote.RemoteLookupTool`: every call waits a
latency drawn uniformly in ``--tool-latency``, up to ``--tool-concurrency``
calls at once per worker, like requests to a remote API).

Only steady-state steps count: the first steps of each run are left out
(Ray and the workers start before step 1; step 1 also pays first-call costs;
in the tool job the policy learns to call the tool in its first 8 steps, from
0.14 calls an episode to about 1, so generation's share of the step settles
only then), and steps per second are the rest over the wall time between the
end of the last step left out and the end of the last step (validation off).
From the ``k=0 pool`` run: G is the seconds per step the trainer waits for
its batch (``async/wait_s``: the weight load, generation and transfer on the
rollout worker) and T the rest of the step period (rewards, log-probs,
values, updates, the weight gather, logging); the ideal speed-up of ``k = 1``
is ``(G + T) / max(G, T)`` on the means, and ``sum(G + T) / sum(max(G, T))``
step by step (lower when G and T trade places from step to step).

    python bench/async_rl.py                  # both jobs, CPU: 12 steps (2 left out), 14 (8)
    python bench/async_rl.py --quick          # a fast check: a quarter of the batch, 5 (2) steps, 1 round
    python bench/async_rl.py --jobs tool --tool-latency 0.1,0.5 --tool-concurrency 512
    python bench/async_rl.py --device cuda    # one card per worker: needs 2 GPUs

Each setup runs ``--rounds`` times (2), in the order k=0, k=1, colocated and
then the other way round, so a drift in the machine's speed falls on all
three alike; the table pools the rounds' steady steps and prints k=1 / k=0
round by round. The load average of the machine is printed before and after
each run: on a shared machine it says how much of a figure is someone else's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SETUPS: dict[str, list[str]] = {
    "k=0 pool": ["rollout.workers=1", "trainer.num_workers=1"],
    "k=1 pool": ["rollout.staleness=1", "trainer.num_workers=1"],
    "colocated": ["trainer.num_workers=2"],
}
"""Each setup's overrides; every one runs two worker processes (one card each on CUDA)."""

QUICK = [
    "data.train_batch_size=32",
    "actor.ppo_mini_batch_size=16",
    "critic.ppo_mini_batch_size=16",
]
"""``--quick``: a quarter of the default batch (two mini-batches, as the default)."""

JOBS: dict[str, tuple[int, int]] = {"default": (12, 2), "tool": (14, 8)}
"""Steps of each run, and how many of the first are left out; ``--quick``: 5 and 2."""

TOOL_TRAINING = ["actor.ppo_epochs=3", "critic.ppo_epochs=2"]
"""The tool job's longer update (the default is 2 and 1 epochs): with it the update (T)
is about as long as the tool-bound generation (G), G/T 1.1-1.2 on 2 CPU cores, where the
default update leaves G 1.67 times T. Overlap gains most where the two are alike."""

TOOL_FILE = '''"""Written by bench/async_rl.py: the remote lookup tool at the bench's latency range."""
from trainer.rollout.tools.remote import RemoteLookupTool

TOOL = RemoteLookupTool(low_s={low!r}, high_s={high!r})
'''


@dataclass
class Run:
    """One setup's steady-state figures."""

    setup: str
    steps_per_s: float
    period_s: float
    gen_s: float
    wait_s: float
    trainer_idle: float | None
    lag_mean: float | None
    load: tuple[float, float]
    """1-minute load average: before and after the run (pooled runs: lowest and highest)."""
    steps: list[tuple[float, float]]
    """Each steady step's (period, seconds waited for the batch)."""


@contextlib.contextmanager
def local_ray(num_cpus: int, device: str = "cpu") -> Iterator[None]:
    """A fresh local Ray cluster started as ``python -m trainer`` starts one; shut down after."""
    import ray

    from rl_e2e.netguard import apply_loopback_guard
    from trainer.launch.runtime_env import get_runtime_env

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_loopback_guard()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=None if device == "cuda" else 0,  # None: Ray counts this node's cards
        include_dashboard=False,
        runtime_env=get_runtime_env(),
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        yield
    finally:
        ray.shutdown()


def _mean(rows: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def measure(
    setup: str, history: list[dict[str, float]], skip: int, load: tuple[float, float]
) -> Run:
    """Steady-state figures of one run from its per-step metrics (``timing/wall`` at each step's end)."""
    skip = max(skip, 1)  # timed from the end of a step: at least the first is left out
    if len(history) <= skip:
        raise SystemExit(f"{setup}: {len(history)} steps, need more than the {skip} left out")
    steady = history[skip:]
    walls = [m["timing/wall"] for m in history[skip - 1 :]]
    periods = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    wait_key = "async/wait_s" if "async/wait_s" in steady[0] else "timing/gen"
    waits = [m[wait_key] for m in steady]
    period = statistics.fmean(periods)
    return Run(
        setup,
        1.0 / period,
        period,
        _mean(steady, "timing/gen") or 0.0,
        statistics.fmean(waits),
        _mean(steady, "async/trainer_idle_frac"),
        _mean(steady, "async/lag_mean"),
        load,
        list(zip(periods, waits, strict=True)),
    )


def pooled(runs: list[Run]) -> Run:
    """One setup's runs (one a round) as one: their steady steps together."""
    steps = [x for r in runs for x in r.steps]
    period = statistics.fmean(p for p, _ in steps)

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.fmean(known) if known else None

    loads = [x for r in runs for x in r.load]
    return Run(
        runs[0].setup,
        1.0 / period,
        period,
        statistics.fmean(r.gen_s for r in runs),
        statistics.fmean(w for _, w in steps),
        mean([r.trainer_idle for r in runs]),
        mean([r.lag_mean for r in runs]),
        (min(loads), max(loads)),
        steps,
    )


def job_overrides(job: str, steps: int, args: argparse.Namespace, tool_spec: str) -> list[str]:
    base = [
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.export_final=false",
        "trainer.tensorboard=false",
        "trainer.progress=false",
        f"trainer.device={args.device}",
        f"seed={args.seed}",
        *(QUICK if args.quick else []),
    ]
    if job == "tool":
        base += [
            "data.task=lookup",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tools=['{tool_spec}']",
            f"rollout.multi_turn.max_concurrency={args.tool_concurrency}",
            *TOOL_TRAINING,
        ]
    return base + args.extra


def run_setup(setup: str, overrides: list[str], run_dir: Path, skip: int) -> Run:
    from trainer.__main__ import run_on_cluster
    from trainer.config import load_config

    cfg = load_config([*overrides, *SETUPS[setup], f"trainer.run_dir={run_dir}"])
    before = os.getloadavg()[0]
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's step lines: not the table
        result = run_on_cluster(cfg)
    run = measure(setup, result.history, skip, (before, os.getloadavg()[0]))
    print(
        f"  {setup:<10} {run.steps_per_s:.3f} steps/s (load {run.load[0]:.1f} -> {run.load[1]:.1f})",
        file=sys.stderr,
        flush=True,
    )
    return run


def report(job: str, title: str, rounds: dict[str, list[Run]]) -> None:
    runs = {setup: pooled(rs) for setup, rs in rounds.items()}
    print(f"\n{title}")
    print(
        f"{'setup':<10} | {'steps/s':>7} {'s/step':>7} {'gen s':>6} {'wait s':>6} "
        f"{'idle':>5} {'lag':>4} | {'load low/high':>17}"
    )
    for r in runs.values():
        idle = f"{r.trainer_idle:.2f}" if r.trainer_idle is not None else "-"
        lag = f"{r.lag_mean:.2f}" if r.lag_mean is not None else "-"
        print(
            f"{r.setup:<10} | {r.steps_per_s:>7.3f} {r.period_s:>7.3f} {r.gen_s:>6.3f} "
            f"{r.wait_s:>6.3f} {idle:>5} {lag:>4} | {r.load[0]:>8.1f} {r.load[1]:>8.1f}"
        )
    k0, k1, col = runs["k=0 pool"], runs["k=1 pool"], runs["colocated"]
    g = k0.wait_s
    t = k0.period_s - g
    ideal = (g + t) / max(g, t)
    per_step = sum(p for p, _ in k0.steps) / sum(max(w, p - w) for p, w in k0.steps)
    speedup = k1.steps_per_s / k0.steps_per_s
    gain = (speedup - 1) / (ideal - 1) if ideal > 1 else float("nan")
    print(
        f"{job}: G {g:.3f} s, T {t:.3f} s (G/T {g / t:.2f}); ideal k=1 speed-up (G+T)/max(G,T) "
        f"{ideal:.3f} (step by step {per_step:.3f})"
    )
    each = [
        a.steps_per_s / b.steps_per_s
        for a, b in zip(rounds["k=1 pool"], rounds["k=0 pool"], strict=True)
    ]
    print(
        f"{job}: k=1 / k=0 {speedup:.3f}x = {speedup / ideal:.1%} of the ideal "
        f"({gain:.1%} of the ideal gain); round by round " + ", ".join(f"{x:.3f}x" for x in each)
    )
    print(
        f"{job}: k=1 / colocated {k1.steps_per_s / col.steps_per_s:.3f}x, "
        f"k=0 pool / colocated {k0.steps_per_s / col.steps_per_s:.3f}x"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", default=["default", "tool"], choices=["default", "tool"])
    p.add_argument("--quick", action="store_true", help="32 prompts a step, 5 steps a run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each setup, the order reversed every other round (default 2; --quick 1)",
    )
    p.add_argument(
        "--tool-latency",
        default="0.1,0.5",
        help="seconds LOW,HIGH of each tool call, drawn uniformly (default 0.1,0.5)",
    )
    p.add_argument(
        "--tool-concurrency",
        type=int,
        default=512,
        help="tool calls in flight per worker (rollout.multi_turn.max_concurrency; default 512)",
    )
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides, every setup")
    args = p.parse_args(argv)
    low, high = (float(x) for x in args.tool_latency.split(","))

    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(
                "bench/async_rl.py: --device cuda needs 2 GPUs (one card per worker), "
                f"this machine shows {torch.cuda.device_count()}",
                file=sys.stderr,
            )
            return 2

    rounds = 1 if args.quick and args.rounds == 2 else args.rounds
    results: dict[str, dict[str, list[Run]]] = {}
    with local_ray(2, args.device), tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        tool_file = Path(tmp) / "remote_tool.py"
        tool_file.write_text(TOOL_FILE.format(low=low, high=high))
        for job in args.jobs:
            print(f"{job}:", file=sys.stderr, flush=True)
            steps, skip = (5, 2) if args.quick else JOBS[job]
            overrides = job_overrides(job, steps, args, f"{tool_file}:TOOL")
            results[job] = {s: [] for s in SETUPS}
            for r in range(rounds):  # k=0, k=1, colocated; then the other way round
                order = list(SETUPS) if r % 2 == 0 else list(SETUPS)[::-1]
                for s in order:
                    run_dir = Path(tmp) / f"{job}-{r}-{len(results[job][s])}-{s[:3]}"
                    results[job][s].append(run_setup(s, overrides, run_dir, skip))

    batch = 32 if args.quick else 128
    print(
        f"device={args.device}, {os.cpu_count()} cores, {batch} prompts x 8 samples a step, "
        f"seed {args.seed}; {rounds} round(s); steps a run (first left out): "
        + ", ".join(f"{j} {(5, 2) if args.quick else JOBS[j]}" for j in args.jobs)
    )
    titles = {
        "default": "default job (python -m trainer: repeat task, GAE)",
        "tool": (
            f"tool job (data.task=lookup, multi-turn, RemoteLookupTool {low:g}-{high:g} s a call, "
            f"{args.tool_concurrency} calls in flight per worker, {' '.join(TOOL_TRAINING)})"
        ),
    }
    for job, runs in results.items():
        report(job, titles[job], runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
