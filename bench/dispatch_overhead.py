"""Overhead of a role group's DP_SPLIT call over hand-written Ray calls.

For 2 and 4 workers and batches of 1 KB, 1 MB and 64 MB, times side by side,
in one run, on one local Ray cluster:

* group:    ``group.forward(batch)`` (pad, chunk, call every rank, wait,
            concatenate, unpad), through ``create_role_groups``;
* ray+cat:  ``concat(ray.get([a.forward.remote(c.clone()) for a, c in
            zip(actors, chunk(batch, n))]))`` on plain Ray actors of the same
            worker class: the same work written by hand, same result;
* ray.get:  the bare ``ray.get([...])`` list, without concatenating.

Calls alternate between the variants (order rotated every round); times are
medians over the rounds, ratios are medians of the per-round ratios
group / ray+cat and group / ray.get (robust to load that drifts during a run).

    python bench/dispatch_overhead.py [--workers 2 4] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch
from tensordict import TensorDict

from trainer.controller import (
    Dispatch,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    create_role_groups,
)
from trainer.data import batch as B

SIZES = {"1 KB": 1 << 10, "1 MB": 1 << 20, "64 MB": 64 << 20}
COLUMNS = 64  # float32 values per row


class EchoWorker(Worker):
    """Returns a same-sized batch computed from its input, as a forward pass would."""

    dispatch = {"forward": Dispatch.DP_SPLIT}

    def forward(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"y": batch["x"] + 1.0}, batch_size=batch.batch_size)


def _batch(nbytes: int) -> TensorDict:
    rows = max(nbytes // (COLUMNS * 4), 4)
    return TensorDict({"x": torch.randn(rows, COLUMNS)}, batch_size=[rows])


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(workers: int, reps: int) -> list[tuple[int, str, float, float, float, float, float]]:
    manager = ResourcePoolManager({"bench": ResourcePool([workers])}, {"echo": "bench"})
    plain_actor = ray.remote(num_cpus=1)(EchoWorker)
    actors = [plain_actor.remote() for _ in range(workers)]
    rows = []
    try:
        group = create_role_groups(manager, {"echo": (EchoWorker, {})})["echo"]

        def by_hand(batch: TensorDict, concat: bool):
            # .clone(): a view would pickle the whole batch's storage to every actor
            parts = [p.clone() for p in B.chunk(batch, workers)]
            results = ray.get([a.forward.remote(p) for a, p in zip(actors, parts, strict=True)])
            return B.concat(results) if concat else results

        for label, nbytes in SIZES.items():
            batch = _batch(nbytes)
            n = reps if nbytes < (16 << 20) else max(3, reps // 5)
            expected = batch["x"] + 1.0
            assert torch.equal(group.forward(batch)["y"], expected)  # warm up, and check
            assert torch.equal(by_hand(batch, True)["y"], expected)
            variants = {
                "group": lambda b=batch: group.forward(b),
                "ray+cat": lambda b=batch: by_hand(b, True),
                "ray.get": lambda b=batch: by_hand(b, False),
            }
            times = {name: [] for name in variants}
            names = list(variants)
            for i in range(n):
                # rotate the order so load changes hit every variant alike
                for name in names[i % 3 :] + names[: i % 3]:
                    times[name].append(_seconds(variants[name]))
            g, rc, rg = (statistics.median(times[k]) for k in names)
            # ratios of paired measurements (same round), then their median
            r_cat = statistics.median(
                a / b for a, b in zip(times["group"], times["ray+cat"], strict=True)
            )
            r_get = statistics.median(
                a / b for a, b in zip(times["group"], times["ray.get"], strict=True)
            )
            rows.append((workers, label, g, rc, rg, r_cat, r_get))
    finally:
        for a in actors:
            ray.kill(a)
        manager.release()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[2, 4], help="group sizes to time"
    )
    parser.add_argument("--reps", type=int, default=50, help="rounds per figure (64 MB: reps/5)")
    args = parser.parse_args()
    if any(w < 1 for w in args.workers) or args.reps < 1:
        parser.error("--workers and --reps must be positive")
    ray.init(address="local", num_cpus=2 * max(args.workers), include_dashboard=False)
    try:
        rows = [row for w in args.workers for row in _measure(w, args.reps)]
    finally:
        ray.shutdown()
    header = f"{'workers':>7} | {'batch':>6} | {'group s':>9} | {'ray+cat s':>9} | {'ray.get s':>9} | {'group/ray+cat':>13} | {'group/ray.get':>13}"
    print(header)
    print("-" * len(header))
    for workers, label, g, rc, rg, r_cat, r_get in rows:
        print(
            f"{workers:>7} | {label:>6} | {g:>9.5f} | {rc:>9.5f} | {rg:>9.5f} | {r_cat:>12.2f}x | {r_get:>12.2f}x"
        )


if __name__ == "__main__":
    main()
