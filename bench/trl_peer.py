"""The TRL side of ``bench/vs_trl.py``: one ``GRPOTrainer`` run, timed, in its own process.

``vs_trl.py`` writes a JSON spec (model directory, data files, reward file,
the ``GRPOConfig`` arguments it derived from its shared settings, the
validation protocol) and runs ``python bench/trl_peer.py SPEC OUT``. This
process trains, and writes OUT: one record per optimizer step (seconds, the
generation / log-prob / update split, response tokens), the validation
rewards, and the peak CUDA memory when on CUDA.

Timing wraps TRL's own methods instead of reading its profiling metrics
(those go only to wandb/mlflow/trackio): ``_generate`` is generation,
``_get_per_token_logps_and_entropies`` called while a batch is prepared is the
separate log-prob pass (none when ``num_iterations=1``), and the rest of the
step (forward, backward, optimizer step) is the update.

With vLLM (``use_vllm=True, vllm_mode="colocate"``; the spec's
``vllm_llm_kwargs`` set) four more things happen here:

- TRL builds its ``vllm.LLM`` itself and exposes no setting for its dtype,
  eager mode or KV-cache bytes, so :func:`llm_with` adds the spec's
  ``vllm_llm_kwargs`` (``dtype``, ``enforce_eager``, ``kv_cache_memory_bytes``)
  to that one call, and refuses to run if TRL starts passing one of them itself.
  Without it TRL's engine would run a float32 model in bfloat16 (vLLM's "auto"
  downcasts float32), compiled with inductor, with a KV cache sized as a
  fraction (``vllm_gpu_memory_utilization``) of *host* memory on CPU.
- On CPU the weight push goes through vLLM's ``reload_weights``
  (:func:`reload_push`): TRL's own push fails on vLLM's CPU backend.
- The weight push (``VLLMGeneration.sync_weights``, which TRL runs at the start
  of the next generation) is timed on its own and counted in the update, where
  the trainer's push sits (the end of its ``update_actor``); ``sync_s`` is
  reported too.
- The rollout-vs-actor mismatch: TRL logs
  ``sampling/sampling_logp_difference/mean`` and ``/max`` only with its
  ``vllm_importance_sampling_correction`` on (it then makes a separate log-prob
  pass). With the correction off, the same statistic (``|logp_actor -
  logp_vllm|`` over the completion tokens: mean and max) is taken here from the
  log-probs the update's own forward computes, compared with the
  ``sampling_per_token_logps`` vLLM returned: no extra pass, as the trainer
  measures it with one on-policy pass. ``logp_diff_source`` says which.

Validation follows the trainer's protocol (``trainer.val_every``,
``rollout.val_n``): every ``val_every`` optimizer steps, ``val_n`` samples per
validation prompt at ``val_temperature``, scored by the same reward function
on the same decoded text; training stops once the mean reaches
``stop_at_val_reward``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's trainer


def decode_like_trainer(
    tokenizer, completion_ids: list[list[int]], skip_special_tokens: bool
) -> list[str]:
    """Completion texts exactly as the trainer's ``decode_responses`` makes them.

    The final EOS is dropped; other special tokens are dropped too unless
    ``skip_special_tokens`` is false (the trainer's ``reward.skip_special_tokens``).
    """
    from trainer.loop.ppo import decode_responses

    width = max((len(ids) for ids in completion_ids), default=0)
    responses = torch.zeros((len(completion_ids), width), dtype=torch.long)
    mask = torch.zeros_like(responses)
    for i, ids in enumerate(completion_ids):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
    return decode_responses(tokenizer, responses, mask, skip_special_tokens)


def make_reward(fn, tokenizer, skip_special_tokens: bool):
    """A TRL reward function over ``completion_ids`` that calls the shared ``fn``."""

    def shared_reward(prompts, completions, completion_ids, ground_truth, **kwargs) -> list[float]:
        texts = decode_like_trainer(tokenizer, completion_ids, skip_special_tokens)
        return [float(fn(t, gt)) for t, gt in zip(texts, ground_truth, strict=True)]

    return shared_reward


def llm_with(llm_class, extra: dict[str, Any]):
    """A stand-in for ``vllm.LLM`` that adds ``extra`` to the keyword arguments TRL passes.

    Raises if TRL already passes one of the keys: the bench would silently
    override a setting TRL has started to choose itself.
    """

    def build(*args, **kwargs):
        clash = sorted(set(extra) & set(kwargs))
        if clash:
            raise RuntimeError(
                f"TRL now passes {clash} to vllm.LLM itself; bench/trl_peer.py would override "
                "them: map them in vs_trl.trl_config instead"
            )
        return llm_class(*args, **kwargs, **extra)

    return build


def reload_push(gen) -> None:
    """TRL's colocated weight push (``VLLMGeneration.sync_weights``), through vLLM's in-place reload.

    TRL 1.16 pushes with the vLLM model's ``load_weights``, one tensor at a
    time. vLLM 0.32's CPU backend repacks each linear layer's weight after
    loading and leaves an empty parameter in its place, so that call fails at
    the first linear layer ("'Parameter' object has no attribute
    'weight_loader'"). ``reload_weights`` re-runs the post-processing; the
    trainer's engine pushes the same way. Same tensors, same names (TRL's own
    ``_iter_named_params``), then TRL's prefix-cache reset.
    """
    if gen.mode != "colocate" or gen.enable_sleep_mode:
        raise RuntimeError("reload_push: only for colocated vLLM without sleep mode")
    gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": gen._iter_named_params()})
    gen.llm.reset_prefix_cache()


def logp_diff_totals(
    actor_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Sum, count and max of ``|actor - sampling|`` over the masked tokens (NaN left out, as TRL)."""
    delta = (actor_logps.detach().float() - sampling_logps.float()).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    return {
        "sum": float(delta.sum()),
        "tokens": float(delta.numel()),
        "max": float(delta.max()) if delta.numel() else 0.0,
    }


def _load_reward(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vs_trl_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


#: What TRL logs as its rollout-vs-actor mismatch (only with its IS correction on).
TRL_LOGP_DIFF = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)


def new_step_record() -> dict[str, float]:
    """Per-step accumulators: phase seconds, response tokens, log-prob mismatch totals."""
    keys = "gen sync log_prob prepare response_tokens lp_sum lp_tokens lp_max".split()
    return dict.fromkeys(keys, 0.0)


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("num_threads"):
        torch.set_num_threads(int(spec["num_threads"]))
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    vllm_kwargs = spec.get("vllm_llm_kwargs")
    if vllm_kwargs:
        import trl.generation.vllm_generation as trl_vllm

        trl_vllm.LLM = llm_with(trl_vllm.LLM, vllm_kwargs)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, local_files_only=True
    )
    reward_fn = _load_reward(spec["reward_file"], spec["reward_name"])
    train = load_dataset("json", data_files=spec["train_file"], split="train")
    val_rows = [json.loads(line) for line in Path(spec["val_file"]).read_text().splitlines()]
    device = torch.device(spec["device"])
    steps: list[dict[str, float]] = []
    vals: list[dict[str, float]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with the phases of each step timed (no change to what it computes)."""

        _cur: dict[str, float]
        _preparing = False
        _update_logps: torch.Tensor | None = None

        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self._cur["gen"] += time.perf_counter() - t0

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if not self._preparing:
                out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
                self._update_logps = out[0]
                return out
            t0 = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                self._cur["log_prob"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            self._preparing = True
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._preparing = False
                self._cur["prepare"] += time.perf_counter() - t0
            if self.model.training:
                self._cur["response_tokens"] += float(out["completion_mask"].sum())
            return out

        def _compute_loss(self, model, inputs):
            """The loss, and the update forward's log-probs against vLLM's (no extra pass)."""
            self._update_logps = None
            loss = super()._compute_loss(model, inputs)
            sampling = inputs.get("sampling_per_token_logps")
            if self._update_logps is not None and sampling is not None:
                mask = inputs["completion_mask"]
                if "tool_mask" in inputs:
                    mask = mask * inputs["tool_mask"]
                t = logp_diff_totals(self._update_logps, sampling, mask)
                c = self._cur
                c["lp_sum"], c["lp_tokens"] = c["lp_sum"] + t["sum"], c["lp_tokens"] + t["tokens"]
                c["lp_max"] = max(c["lp_max"], t["max"])
            self._update_logps = None
            return loss

    def validate(model) -> float:
        """Mean shared reward of ``val_n`` samples per validation prompt (trainer's protocol)."""
        n = spec["val_n"]
        texts = [r["prompt"] for r in val_rows for _ in range(n)]
        gts = [r["ground_truth"] for r in val_rows for _ in range(n)]
        enc = tok(texts, return_tensors="pt", padding=True).to(device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=spec["max_new_tokens"],
                    do_sample=True,
                    temperature=spec["val_temperature"],
                    top_p=1.0,
                    top_k=0,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                    use_cache=True,
                )
        finally:
            model.train(was_training)
        rows = [
            row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            for row in out[:, enc["input_ids"].shape[1] :].tolist()
        ]
        texts = decode_like_trainer(tok, rows, spec["skip_special_tokens"])
        scores = [float(reward_fn(t, gt)) for t, gt in zip(texts, gts, strict=True)]
        return sum(scores) / len(scores)

    class StepClock(TrainerCallback):
        """Times each optimizer step, then validates (outside the timed step)."""

        def on_step_begin(self, args, state, control, **kwargs):
            trainer._cur = new_step_record()
            self.logged = {k: len(trainer._metrics["train"].get(k, [])) for k in TRL_LOGP_DIFF}
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self.t0
            c = trainer._cur
            # The weight push runs inside _generate; the trainer's is in its update.
            record = {
                "step": state.global_step,
                "step_s": elapsed,
                "gen_s": c["gen"] - c["sync"],
                "log_prob_s": c["log_prob"],
                "other_s": c["prepare"] - c["gen"] - c["log_prob"],
                "update_s": elapsed - c["prepare"] + c["sync"],
                "response_tokens": c["response_tokens"],
            }
            if use_vllm:
                record["sync_s"] = c["sync"]
                record.update(self._logp_diff(c))
            steps.append(record)
            every = spec["val_every"]
            if every and state.global_step % every == 0:
                t0 = time.perf_counter()
                reward = validate(trainer.model)
                vals.append(
                    {"step": state.global_step, "reward": reward, "s": time.perf_counter() - t0}
                )
                stop = spec["stop_at_val_reward"]
                if stop and reward >= stop:
                    control.should_training_stop = True
            return control

        def _logp_diff(self, c: dict[str, float]) -> dict[str, Any]:
            """This step's mismatch: TRL's own metric when it logged one, else the update's."""
            logged = trainer._metrics["train"]
            mean_key, max_key = TRL_LOGP_DIFF
            if len(logged.get(mean_key, [])) > self.logged[mean_key]:
                return {
                    "logp_diff_mean": logged[mean_key][-1],
                    "logp_diff_max": logged[max_key][-1],
                    "logp_diff_source": "TRL sampling/sampling_logp_difference",
                }
            if c["lp_tokens"] == 0:
                return {}
            return {
                "logp_diff_mean": c["lp_sum"] / c["lp_tokens"],
                "logp_diff_max": c["lp_max"],
                "logp_diff_source": "update forward vs sampling_per_token_logps",
            }

    t_start = time.perf_counter()
    args = GRPOConfig(**spec["grpo_config"])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=make_reward(reward_fn, tok, spec["skip_special_tokens"]),
        args=args,
        train_dataset=train,
        processing_class=tok,
        callbacks=[StepClock()],
    )
    trainer._cur = new_step_record()
    use_vllm = bool(args.use_vllm)
    if use_vllm:
        gen = trainer.vllm_generation
        push = functools.partial(reload_push, gen) if device.type == "cpu" else gen.sync_weights

        def timed_push() -> None:
            t0 = time.perf_counter()
            try:
                push()
            finally:
                trainer._cur["sync"] += time.perf_counter() - t0

        trainer.vllm_generation.sync_weights = timed_push
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_train = time.perf_counter()
    trainer.train()
    result: dict[str, Any] = {
        "steps": steps,
        "val": vals,
        "setup_s": t_train - t_start,
        "train_s": time.perf_counter() - t_train,
        "device": str(trainer.accelerator.device),
        "num_threads": torch.get_num_threads(),
        "max_memory_allocated": (
            torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        ),
    }
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python bench/trl_peer.py SPEC.json OUT.json (run by bench/vs_trl.py)")
    sys.exit(main(sys.argv[1], sys.argv[2]))
