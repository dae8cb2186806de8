"""Rollout with vLLM, colocated with the FSDP2 actor on the same cards.

Imported only when ``rollout.engine=vllm`` (by :func:`trainer.rollout.build_engine`);
``vllm`` itself is imported inside :class:`VLLMEngine`, so the pure helpers here
(weight-name mapping, sampling-parameter mapping, prompt grouping, the
availability check) are importable and tested without it.

Life cycle per PPO step, on every data-parallel rank (one engine per rank,
``data_parallel_size`` = the trainer's world size, vLLM's ``external_launcher``
so it joins the ranks' existing ``torch.distributed`` world):

1. after the actor update, :meth:`VLLMEngine.sync_weights` wakes the weights,
   gathers the actor's parameters one tensor at a time (FSDP2 ``full_tensor``)
   and feeds them to the model's ``load_weights`` through the engine's worker
   RPC: no disk round trip, at most one full tensor extra in memory;
2. :meth:`VLLMEngine.generate` wakes the KV cache, samples, and puts the engine
   back to sleep (level 1: KV cache discarded, weights moved to host memory),
   so the update that follows has the card's memory.

Not verified on a GPU in this repository (see docs/trainer.md): the calls
follow vLLM's documented ``LLM`` API (``enable_sleep_mode``, ``sleep``,
``wake_up(tags=...)``, ``collective_rpc``, ``external_launcher``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator
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
    "group_repeated_prompts",
    "hf_weight_name",
    "require_vllm",
    "vllm_sampling_kwargs",
    "weights_for_vllm",
]


def require_vllm() -> None:
    """Raise ``ImportError`` naming ``rollout.engine=vllm`` and the package when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "rollout.engine=vllm needs the 'vllm' package, which is not installed in this "
            "environment (pip install vllm, on a CUDA machine); or use rollout.engine=hf"
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
    HF engine does; token ids are returned without detokenizing.
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


def _unpadded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]


def _pad_rows(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker (in this process): load a chunk of weights into its model."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


class VLLMEngine:
    """A vLLM ``LLM`` in this rank's process, fed the actor's weights after every update."""

    #: Weights are pushed in chunks of at most this many bytes (full tensors).
    CHUNK_BYTES = 256 * 2**20

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        model_path: str,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        dtype: str = "bfloat16",
    ) -> None:
        require_vllm()
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.engine=vllm needs CUDA; this worker has no GPU")
        import torch.distributed as dist
        from vllm import LLM

        # In-process engine core: the RPC below then passes tensors by reference.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        world = dist.get_world_size() if dist.is_initialized() else 1
        extra: dict[str, Any] = {}
        if world > 1:
            # One engine per trainer rank, joining the ranks' torch.distributed world.
            extra.update(distributed_executor_backend="external_launcher", data_parallel_size=world)
        self.model = model
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self.llm = LLM(
            model=model_path,
            tokenizer=model_path,
            skip_tokenizer_init=True,
            dtype=dtype,
            tensor_parallel_size=1,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            enforce_eager=True,
            seed=seed,
            **extra,
        )
        self.llm.sleep(level=1)
        self.weights_awake = False

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Push the actor's current weights into vLLM (every rank joins the gathers)."""
        if not self.weights_awake:
            self._wake(["weights"])
            self.weights_awake = True
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in weights_for_vllm(_full_tensors(self.model), self.tied):
            chunk.append((name, t))
            size += t.numel() * t.element_size()
            if size >= self.CHUNK_BYTES:
                self.llm.collective_rpc(_load_weights_on_worker, args=(chunk,))
                chunk, size = [], 0
        if chunk:
            self.llm.collective_rpc(_load_weights_on_worker, args=(chunk,))
        torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Sample one response per row; consecutive repeats of a prompt become one ``n`` request."""
        from vllm import SamplingParams as VSamplingParams

        ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
        runs = group_repeated_prompts(_unpadded_prompts(ids, mask))
        requests = [{"prompt_token_ids": p} for p, _ in runs]
        sampling = [
            VSamplingParams(**vllm_sampling_kwargs(params, n, self.eos_token_id)) for _, n in runs
        ]
        if not self.weights_awake:
            self._wake(["weights"])
        self._wake(["kv_cache"])
        try:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        finally:
            self.llm.sleep(level=1)
            self.weights_awake = False
        generated = [list(c.token_ids) for out in outputs for c in out.outputs]
        if len(generated) != ids.shape[0]:
            raise RuntimeError(
                f"vLLM returned {len(generated)} samples for {ids.shape[0]} prompt rows"
            )
        return finish_responses(
            ids,
            mask,
            _pad_rows(generated, self.pad_token_id),
            params.max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )


def _full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter; FSDP2 shards are all-gathered one at a time."""
    from torch.distributed.tensor import DTensor

    device = torch.device("cuda", torch.cuda.current_device())
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            # With CPU offload the shards live in host memory; NCCL gathers on the card.
            t = t.to(device).full_tensor()
        yield name, t.detach()
