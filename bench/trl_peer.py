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

Validation follows the trainer's protocol (``trainer.val_every``,
``rollout.val_n``): every ``val_every`` optimizer steps, ``val_n`` samples per
validation prompt at ``val_temperature``, scored by the same reward function
on the same decoded text; training stops once the mean reaches
``stop_at_val_reward``.
"""

from __future__ import annotations

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
    from trainer.ppo import decode_responses

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


def _load_reward(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vs_trl_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


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

        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self._cur["gen"] += time.perf_counter() - t0

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if not self._preparing:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
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
            trainer._cur = {"gen": 0.0, "log_prob": 0.0, "prepare": 0.0, "response_tokens": 0.0}
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self.t0
            c = trainer._cur
            steps.append(
                {
                    "step": state.global_step,
                    "step_s": elapsed,
                    "gen_s": c["gen"],
                    "log_prob_s": c["log_prob"],
                    "other_s": c["prepare"] - c["gen"] - c["log_prob"],
                    "update_s": elapsed - c["prepare"],
                    "response_tokens": c["response_tokens"],
                }
            )
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
    trainer._cur = {"gen": 0.0, "log_prob": 0.0, "prepare": 0.0, "response_tokens": 0.0}
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
