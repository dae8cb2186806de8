"""Peak host memory per rank while saving a checkpoint, and the whole cost of a save to training.

A 57M-parameter Llama (hidden 768, 8 layers, built locally) is sharded with
FSDP2 over 2 gloo ranks with AdamW state (fp32 weights + 2 moments: about
680 MB of state, 340 MB per rank). Each setup runs in fresh processes, one
after the other, in this one run:

- ``full-gather``: the previous checkpoint code: the full model and optimizer
  state gathered to rank 0 (``get_*_state_dict(full_state_dict=True,
  cpu_offload=True)``) and pickled with ``torch.save``;
- ``sharded``: :class:`trainer.workers.state.CheckpointSaver`, synchronous:
  every rank writes its own shard with ``torch.distributed.checkpoint``;
- ``async``: the same saver with ``asynchronous=True``: the state is staged
  to host memory, and a training step runs while it is written.

Memory is the peak resident set size above the rank's size before the save,
sampled every millisecond by a thread (glibc returns freed blocks at once:
``MALLOC_MMAP_THRESHOLD_=65536``).

Time, for ``sharded`` and ``async``, over ``--rounds`` rounds of: a training
step alone, then a save, the next step, and the wait for the write (medians
over the rounds, worst rank):

- "blocked": the time the loop waits for the checkpoint: the whole save when
  synchronous; the staging plus any wait left after the next step when
  asynchronous;
- "whole": blocked plus the next step's slowdown (the step after the save
  minus the step alone of the same round): what a save costs the run. A
  background write that competes with the step for the cores shows here.

    python bench/checkpoint_memory.py            # ~2 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

# Large tensors in their own mappings, so that freeing one shows in the RSS at once.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from rl_e2e.distributed import run_distributed  # noqa: E402
from trainer.models import TinySpec, ensure_tiny_model  # noqa: E402

SPEC = TinySpec(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=128,
)
MODES = ("full-gather", "sharded", "async")


def _rss() -> int:
    return psutil.Process().memory_info().rss


class _PeakRSS:
    """Sample this process's RSS every millisecond in a thread; ``peak`` is the maximum."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _trim() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _train_step(model, opt, batch) -> None:
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _timed_step(model, opt, batch) -> float:
    t = time.perf_counter()
    _train_step(model, opt, batch)
    return time.perf_counter() - t


def _rank(rank: int, world: int, model_dir: str, mode: str, out: str, rounds: int) -> dict:
    from trainer import fsdp
    from trainer.config import OptimConfig
    from trainer.workers.setup import build_actor, build_optimizer
    from trainer.workers.state import CheckpointSaver

    torch.set_num_threads(1)
    model = fsdp.shard_model(build_actor(model_dir), torch.device("cpu"))
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-4))
    batch = torch.randint(7, 20, (2, 32), generator=torch.Generator().manual_seed(rank))
    _train_step(model, opt, batch)  # AdamW state exists, as in training
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    shard += sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.nbytes
        for s in opt.state.values()
        for t in s.values()
    )
    _trim()
    before = _rss()
    saver = CheckpointSaver("actor", rank)
    alone, blocked, after = [], [], []
    with _PeakRSS() as peak:
        if mode == "full-gather":
            t0 = time.perf_counter()
            state = fsdp.full_state_dict(model)
            optim = fsdp.full_optimizer_state_dict(model, opt)
            if rank == 0:
                torch.save({"model": state, "optimizer": optim}, Path(out) / "actor_state.pt")
            del state, optim
            blocked.append(time.perf_counter() - t0)
        else:
            for i in range(rounds):
                alone.append(_timed_step(model, opt, batch))  # no checkpoint beside it
                t0 = time.perf_counter()
                saver.save(Path(out) / str(i), model, opt, None, asynchronous=mode == "async")
                staged = time.perf_counter() - t0
                after.append(_timed_step(model, opt, batch))
                t1 = time.perf_counter()
                saver.wait()
                blocked.append(staged + time.perf_counter() - t1)
    row = {"peak": peak.peak - before, "shard": shard, "blocked": _median(blocked)}
    if after:
        slow = [a - b for a, b in zip(after, alone, strict=True)]
        row.update(
            step=_median(after),
            alone=_median(alone),
            whole=_median([b + d for b, d in zip(blocked, slow, strict=True)]),
        )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cache", default=None, help="where the bench model is built (default: a temp dir)"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="save rounds per setup (medians; default 3)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        model_dir = str(ensure_tiny_model(SPEC, cache_dir=args.cache or tmp))
        from safetensors.torch import load_file

        n = sum(t.numel() for t in load_file(str(Path(model_dir) / "model.safetensors")).values())
        print(f"model: {n / 1e6:.1f}M parameters (fp32), AdamW; 2 gloo ranks, FSDP2")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rows = {}
        for mode in MODES:
            out = Path(tmp) / mode
            out.mkdir()
            rows[mode] = run_distributed(
                _rank, 2, model_dir, mode, str(out), args.rounds, backend="gloo", timeout_s=1800
            )
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        mb = 2**20
        print(
            f"{'setup':<12} {'rank':>4} {'shard MB':>9} {'peak above start MB':>20} "
            f"{'blocked s':>10} {'next step s':>12} {'alone s':>8} {'whole s':>8}"
        )
        for mode, ranks in rows.items():
            for r, row in enumerate(ranks):
                times = (
                    f"{row['step']:>12.2f} {row['alone']:>8.2f} {row['whole']:>8.2f}"
                    if "whole" in row
                    else ""
                )
                print(
                    f"{mode:<12} {r:>4} {row['shard'] / mb:>9.0f} {row['peak'] / mb:>20.0f} "
                    f"{row['blocked']:>10.2f} {times}".rstrip()
                )

        def worst(mode: str, key: str) -> float:
            return max(r[key] for r in rows[mode])

        full, sharded = worst("full-gather", "peak"), worst("sharded", "peak")
        print(f"peak memory, sharded / full gather (worst rank): {sharded / full:.2f}")
        for key, what in (
            ("blocked", "step blocked"),
            ("whole", "whole cost (blocked + slowdown)"),
        ):
            a, s = worst("async", key), worst("sharded", key)
            print(f"{what}, async / sync save (worst rank): {a / s:.2f} ({a:.2f} s vs {s:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
