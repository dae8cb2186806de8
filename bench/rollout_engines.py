"""Rollout speed: Hugging Face ``generate`` next to vLLM, same weights, prompts and sampling.

Both engines are the trainer's own (:func:`trainer.rollout.build_engine`), at
two model shapes built here in a temp dir (nothing is downloaded): the
trainer's default tiny Llama (:class:`trainer.models.TinySpec`, 86K
parameters) and a 22.5M-parameter one built the same way (hidden 512, MLP
1408, 7 layers, 8 heads of dimension 64). Each engine and shape runs in its
own spawned process, a gloo world of one
(:func:`rl_e2e.distributed.run_distributed`; the vLLM engine joins that
world), so start-up figures include fresh imports.

    python bench/rollout_engines.py                       # 32 prompts x 8 samples, 32 new tokens
    python bench/rollout_engines.py --greedy              # ... plus a greedy (temperature 0) pass
    python bench/rollout_engines.py --threads 2 --shapes 22.5m
    python bench/rollout_engines.py --prompts 8 --n 4 --repeats 3   # quicker

Figures per shape and engine:

- ``import s``: the one-time ``import vllm`` plus ``vllm.LLM`` (the package
  imports lazily; the second is most of it), in a fresh process
  where torch and transformers are already imported (HF: ``-``, the trainer
  imports transformers whichever engine it uses);
- ``start-up s``: HF, loading the actor (``from_pretrained``, the engine is
  the actor itself); vLLM, constructing ``VLLMEngine`` on an already loaded
  actor (model load, KV cache, scheduler);
- ``s/batch``: median seconds of one ``engine.generate`` on the whole batch,
  over ``--repeats`` batches after ``--warmup`` untimed ones;
- ``cpu s``: median CPU seconds of the engine's process per batch (all its
  threads; the vLLM engine core runs in that process): near ``s/batch`` on
  an idle machine, and the steadier figure when other work shares the cores;
- ``tok/s``: median over the timed batches of generated response tokens
  (``response_mask.sum()``) divided by that batch's seconds (a median, so one
  batch slowed by other work on the machine does not move it); ``tok/batch``
  is the mean response tokens per batch;
- ``sync s``: one ``sync_weights`` after the timed batches (HF: a no-op).

Every process computes with ``--threads`` torch threads (default 1), set
before the vLLM engine is built (its CPU worker turns ``torch.set_num_threads``
into a no-op). The prompts are the synthetic task's first ``--prompts``
prompts, each repeated ``--n`` times in place (as the driver does, so vLLM
shares each prompt's prefill over its ``n`` samples; greedy rows are one
request each, since vLLM refuses ``n > 1`` when greedy). The script prints
figures; it asserts nothing about them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ppo_step import _choices  # bench/ is the script's directory, so on sys.path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read by each engine process

#: The shapes this benchmark compares, as ``TinySpec`` keyword arguments.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},  # the trainer's default: hidden 64, 2 layers, 2 heads of dimension 32
    "22.5m": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=7,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    ),
}
ENGINES = ("hf", "vllm")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts per batch")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="max new tokens per response")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--greedy", action="store_true", help="also time greedy (temperature 0)")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per engine and shape")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of both engines")
    p.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}"
    )
    p.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated: {', '.join(ENGINES)}"
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=0,
        help="vLLM KV cache size; 0 (default): twice what the whole batch needs, at least 64",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine process")
    args = p.parse_args(argv)
    args.shape_names = _choices(p, "--shapes", args.shapes, tuple(SHAPES))
    args.engine_names = _choices(p, "--engines", args.engines, ENGINES)
    for flag in ("prompts", "n", "new_tokens", "repeats", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def _prompts(model_dir: str, n_prompts: int, n: int):
    """The synthetic task's first ``n_prompts`` prompts, each repeated ``n`` times in place."""
    from trainer.config import load_config
    from trainer.data import batch as batch_ops
    from trainer.data.prompts import build_datasets
    from trainer.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    cfg = load_config([f"data.num_train_examples={max(n_prompts, 4)}", "data.num_val_examples=4"])
    train, _ = build_datasets(cfg, tok)
    td, _, _ = train.batch(range(n_prompts))
    return batch_ops.repeat_interleave(td, n)


def _kv_cache_bytes(model_dir: str, seqs: int, seq_len: int) -> int:
    """Twice the fp32 KV cache of ``seqs`` sequences of ``seq_len`` tokens (at least 64 MiB).

    Twice: room for vLLM's block rounding, so the whole batch is scheduled at
    once and no request waits for cache space.
    """
    from trainer.rollout.vllm import model_head_dim

    config = json.loads((Path(model_dir) / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * model_head_dim(config) * 4
    return max(64 * 2**20, 2 * seqs * (seq_len + 16) * per_token)


def _time_batches(engine, prompts, params, warmup: int, repeats: int) -> dict[str, list]:
    """Wall seconds, CPU seconds and response tokens of each timed ``engine.generate``.

    CPU seconds are this process's, all threads; ``warmup`` calls go first, untimed.
    """
    for _ in range(warmup):
        engine.generate(prompts, params)
    run: dict[str, list] = {"seconds": [], "cpu_seconds": [], "tokens": []}
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, params)
        run["seconds"].append(time.perf_counter() - t0)
        run["cpu_seconds"].append(time.process_time() - c0)
        run["tokens"].append(int(out["response_mask"].sum()))
    return run


def measure_engine(
    rank: int, world: int, engine_name: str, model_dir: str, opts: dict[str, Any]
) -> dict[str, Any]:
    """One engine on one shape, in a fresh process: start-up, then timed batches per sampling.

    Run by :func:`rl_e2e.distributed.run_distributed` (world of one, gloo),
    which the vLLM engine joins. Returns plain numbers for the table.
    """
    import torch

    torch.set_num_threads(opts["threads"])  # before vLLM's worker makes this a no-op
    torch.manual_seed(opts["seed"])
    from trainer.models import load_tokenizer
    from trainer.rollout import SamplingParams, build_engine
    from trainer.workers.actor import place_model
    from trainer.workers.setup import build_actor

    figures: dict[str, Any] = {"import_s": None}
    if engine_name == "vllm":
        t0 = time.perf_counter()
        import vllm  # timed: the one-time import cost

        _ = vllm.LLM  # vllm/__init__ is lazy: this attribute imports the bulk of it
        figures["import_s"] = time.perf_counter() - t0
    tok = load_tokenizer(model_dir)
    t0 = time.perf_counter()
    actor = place_model(build_actor(model_dir), torch.device("cpu"), "ddp")
    load_s = time.perf_counter() - t0
    figures["params"] = sum(p.numel() for p in actor.parameters())
    t0 = time.perf_counter()
    if engine_name == "vllm":
        engine = build_engine(
            "vllm",
            actor,
            tok,
            model_path=model_dir,
            device=torch.device("cpu"),
            kv_cache_memory=opts["kv_cache_bytes"],
            seed=opts["seed"],
        )
        figures["startup_s"] = time.perf_counter() - t0
    else:
        engine = build_engine("hf", actor, tok)
        figures["startup_s"] = load_s + (time.perf_counter() - t0)
    figures["threads"] = torch.get_num_threads()
    try:
        figures["runs"] = {}
        for label, (temperature, prompts) in opts["samplings"].items():
            params = SamplingParams(max_new_tokens=opts["new_tokens"], temperature=temperature)
            figures["runs"][label] = _time_batches(
                engine, prompts, params, opts["warmup"], opts["repeats"]
            )
        t0 = time.perf_counter()
        engine.sync_weights()
        figures["sync_s"] = time.perf_counter() - t0
    finally:
        if hasattr(engine, "close"):
            engine.close()
    return figures


def _row(shape: str, engine: str, label: str, fig: dict[str, Any]) -> dict[str, Any]:
    run = fig["runs"][label]
    secs, toks = run["seconds"], run["tokens"]
    return {
        "shape": shape,
        "params": fig["params"],
        "engine": engine,
        "sampling": label,
        "import_s": fig["import_s"],
        "startup_s": fig["startup_s"],
        "s_batch": statistics.median(secs),
        "stdev": statistics.stdev(secs) if len(secs) > 1 else 0.0,
        "cpu_batch": statistics.median(run["cpu_seconds"]),
        "tok_batch": sum(toks) / len(toks),
        "tok_s": statistics.median(t / s for t, s in zip(toks, secs, strict=True)),
        "sync_s": fig["sync_s"],
        "threads": fig["threads"],
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"| {'shape':<6} | {'params':>7} | {'engine':<6} | {'sampling':<8} | {'import s':>8} "
        f"| {'start-up s':>10} | {'s/batch':>7} | {'stdev':>6} | {'cpu s':>6} | {'tok/batch':>9} "
        f"| {'tok/s':>7} | {'sync s':>6} | {'threads':>7} |"
    )
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        imp = "-" if r["import_s"] is None else f"{r['import_s']:.1f}"
        print(
            f"| {r['shape']:<6} | {r['params'] / 1e6:6.2f}M | {r['engine']:<6} "
            f"| {r['sampling']:<8} | {imp:>8} | {r['startup_s']:10.1f} | {r['s_batch']:7.3f} "
            f"| {r['stdev']:6.3f} | {r['cpu_batch']:6.3f} | {r['tok_batch']:9.0f} "
            f"| {r['tok_s']:7.0f} "
            f"| {r['sync_s']:6.3f} | {r['threads']:>7} |"
        )


def _print_ratios(rows: list[dict[str, Any]]) -> None:
    by_key = {(r["shape"], r["sampling"], r["engine"]): r for r in rows}
    for (shape, sampling, engine), r in by_key.items():
        hf = by_key.get((shape, sampling, "hf"))
        if engine == "vllm" and hf is not None:
            print(
                f"vLLM/HF tok/s, {shape} ({r['params'] / 1e6:.2f}M), {sampling}: "
                f"{r['tok_s'] / hf['tok_s']:.2f}x"
            )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from rl_e2e.distributed import run_distributed
    from trainer.models import TinySpec, ensure_tiny_model
    from trainer.rollout.vllm import require_vllm

    if "vllm" in args.engine_names:
        require_vllm()
    temperatures = {f"T={args.temperature:g}": args.temperature}
    if args.greedy:
        temperatures["greedy"] = 0.0
    seqs = args.prompts * args.n
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollout-engines-") as cache:
        dirs = {s: str(ensure_tiny_model(TinySpec(**SHAPES[s]), cache)) for s in args.shape_names}
        prompts = _prompts(next(iter(dirs.values())), args.prompts, args.n)
        seq_len = prompts["input_ids"].shape[1] + args.new_tokens
        samplings = {label: (t, prompts) for label, t in temperatures.items()}
        for shape, model_dir in dirs.items():
            kv = args.kv_cache_mib * 2**20 or _kv_cache_bytes(model_dir, seqs, seq_len)
            opts = {
                "threads": args.threads,
                "seed": args.seed,
                "new_tokens": args.new_tokens,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "samplings": samplings,
                "kv_cache_bytes": kv,
            }
            for engine in args.engine_names:
                print(f"running {engine} on {shape} ...", file=sys.stderr, flush=True)
                (fig,) = run_distributed(
                    measure_engine,
                    1,
                    engine,
                    model_dir,
                    opts,
                    backend="gloo",
                    timeout_s=args.timeout,
                )
                rows.extend(_row(shape, engine, label, fig) for label in samplings)
    load_after = os.getloadavg()
    print(
        f"\nRollout engines: {args.prompts} prompts x {args.n} samples = {seqs} sequences/batch, "
        f"prompt width {prompts['input_ids'].shape[1]}, {args.new_tokens} new tokens, "
        f"median of {args.repeats} batches after {args.warmup} warm-up, "
        f"{args.threads} torch thread(s) per engine, CPU ({os.cpu_count()} cores)\n"
    )
    _print_table(rows)
    print()
    _print_ratios(rows)
    print(
        "\nstart-up: HF = actor from_pretrained; vLLM = VLLMEngine(...) on a loaded actor, "
        "without importing vllm (its own column)"
    )
    print(
        "load average (1, 5, 15 min): before "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; after "
        + ", ".join(f"{x:.2f}" for x in load_after)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
