"""A plain single-process loop of the same PPO/GRPO math, no Ray, no workers.

It calls the very functions the Ray workers call (:mod:`trainer.workers.compute`)
and the driver's math (:mod:`trainer.loop.ppo`), on the whole batch in one process.
Two uses: the baseline of ``bench/ppo_step.py`` (what the single-controller
machinery costs), and a fast place to tune hyper-parameters.

Run it: ``python -m trainer.loop.reference algo=grpo trainer.total_steps=60``.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np
import torch

from trainer.algorithms import ppo_math as algos
from trainer.config import Config, load_config
from trainer.data.batch import group_ids_for
from trainer.data.prompts import PromptLoader, build_datasets
from trainer.loop.ppo import (
    apply_kl_in_reward,
    compute_advantages,
    decode_responses,
    explained_variance,
    finished_mask,
    masked_mean,
    needs_old_log_prob_pass,
    resolve_reward_fn,
    response_length,
    score_responses,
    token_level_rewards,
)
from trainer.models import load_tokenizer, resolve_model_path
from trainer.rollout import build_engine
from trainer.workers.compute import compute_log_probs, compute_values, update_policy, update_value
from trainer.workers.settings import (
    policy_settings,
    sampling_params,
    share_prompt,
    value_settings,
)
from trainer.workers.setup import build_actor, build_critic, build_optimizer


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ReferenceLoop:
    """Everything of a run in one process: models, optimizers, data, engine."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        if cfg.trainer.use_gpu and not torch.cuda.is_available():
            raise RuntimeError("trainer.use_gpu=true but torch.cuda.is_available() is False")
        if cfg.rollout.multi_turn.enable:
            raise ValueError(
                "rollout.multi_turn.enable=true: the reference loop samples single responses "
                "only; run multi-turn training with python -m trainer"
            )
        if cfg.rollout.engine != "hf":
            raise ValueError(
                f"rollout.engine={cfg.rollout.engine}: the reference loop samples with the "
                "actor's own module (hf) only, having no torch.distributed world for vLLM to "
                "join; run vLLM rollouts with python -m trainer"
            )
        self.device = torch.device("cuda" if cfg.trainer.use_gpu else "cpu")
        seed_everything(cfg.seed)
        path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(path)
        self.actor = build_actor(path).to(self.device)
        self.actor_opt, self.actor_sched = build_optimizer(self.actor, cfg.actor.optim)
        self.ref = build_actor(path).to(self.device).eval() if cfg.use_reference else None
        self.critic = build_critic(path, cfg.seed).to(self.device) if cfg.use_critic else None
        if self.critic is not None:
            self.critic_opt, self.critic_sched = build_optimizer(self.critic, cfg.critic.optim)
        self.engine = build_engine(cfg.rollout.engine, self.actor, self.tokenizer)
        self.train, self.val = build_datasets(cfg, self.tokenizer)
        self.loader = PromptLoader(
            len(self.train), cfg.data.train_batch_size, cfg.seed, cfg.data.shuffle
        )
        self.reward_fn = resolve_reward_fn(cfg)
        self.max_new = response_length(cfg)
        a = cfg.algorithm
        self.kl_ctrl = (
            algos.AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon)
            if a.kl_ctrl == "adaptive"
            else algos.FixedKLController(a.kl_coef)
        )

    def step(self, step: int) -> dict[str, float]:
        """One PPO iteration on a fresh batch; returns its metrics."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t0 = time.perf_counter()
        idx = self.loader.next_indices()
        prompts, gts, extras = self.train.batch(idx)
        rep = torch.arange(len(idx)).repeat_interleave(n)
        dev = self.device
        batch = self.engine.generate(prompts[rep].to(dev), sampling_params(cfg, self.max_new)).to(
            "cpu"
        )
        gts = [gts[i] for i in rep.tolist()]
        extras = [extras[i] for i in rep.tolist()]
        mask = batch["response_mask"]
        t_gen = time.perf_counter()

        texts = decode_responses(
            self.tokenizer, batch["responses"], mask, cfg.reward.skip_special_tokens
        )
        finished = (
            None
            if cfg.reward.score_unfinished
            else finished_mask(batch["responses"], mask, self.tokenizer.eos_token_id)
        )
        scores = score_responses(self.reward_fn, texts, gts, extras, finished)
        rewards = token_level_rewards(scores, mask)
        mb = (cfg.actor.micro_batch_size, cfg.actor.micro_batch_tokens, share_prompt(cfg))
        metrics: dict[str, float] = {}
        if needs_old_log_prob_pass(cfg):
            old, entropy = compute_log_probs(
                self.actor, batch.to(dev), cfg.rollout.temperature, *mb
            )
            batch["old_log_probs"] = old.cpu()
            metrics["actor/entropy"] = masked_mean(entropy.cpu(), mask)
        if self.ref is not None:
            ref, _ = compute_log_probs(self.ref, batch.to(dev), cfg.rollout.temperature, *mb)
            batch["ref_log_probs"] = ref.cpu()
        if cfg.algorithm.use_kl_in_reward:
            rewards, kl = apply_kl_in_reward(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                mask,
                cfg.algorithm.kl_penalty,
                self.kl_ctrl.value,
            )
            self.kl_ctrl.update(kl, len(idx) * n)
            metrics.update({"actor/reward_kl": kl, "actor/kl_coef": float(self.kl_ctrl.value)})
        values = None
        if self.critic is not None:
            c = cfg.critic
            values = compute_values(
                self.critic, batch.to(dev), c.micro_batch_size, c.micro_batch_tokens
            ).cpu()
            batch["values"] = values
        adv, ret = compute_advantages(
            cfg.algo,
            rewards,
            mask,
            group_ids_for(len(idx), n),
            values,
            cfg.algorithm.gamma,
            cfg.algorithm.lam,
            cfg.algorithm.grpo_std_eps,
        )
        batch["advantages"], batch["returns"] = adv, ret
        t_prep = time.perf_counter()

        if self.critic is not None:
            vs = value_settings(cfg, step)
            metrics.update(update_value(self.critic, self.critic_opt, batch.to(dev), vs))
            self.critic_sched.step()
            metrics["critic/explained_variance"] = explained_variance(values, ret, mask)
        if step >= cfg.critic.warmup_steps:
            ps = policy_settings(cfg, step)
            metrics.update(update_policy(self.actor, self.actor_opt, batch.to(dev), ps))
            self.actor_sched.step()
        t_end = time.perf_counter()
        n_tokens = int(mask.sum())
        metrics.update(
            {
                "rollout/reward_mean": float(scores.mean()),
                "rollout/response_length": float(mask.sum(1).float().mean()),
                "actor/lr": float(self.actor_sched.get_last_lr()[0]),
                "timing/gen": t_gen - t0,
                "timing/prep": t_prep - t_gen,
                "timing/update": t_end - t_prep,
                "timing/step": t_end - t0,
                "perf/tokens_per_s": n_tokens / max(t_end - t0, 1e-9),
            }
        )
        return metrics

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean reward over the validation set at the validation temperature."""
        cfg, vn = self.cfg, self.cfg.rollout.val_n
        idx = list(range(len(self.val)))
        prompts, gts, extras = self.val.batch(idx)
        rep = torch.arange(len(idx)).repeat_interleave(vn)
        params = sampling_params(cfg, self.max_new, validation=True)
        out = self.engine.generate(prompts[rep].to(self.device), params).to("cpu")
        texts = decode_responses(
            self.tokenizer, out["responses"], out["response_mask"], cfg.reward.skip_special_tokens
        )
        finished = (
            None
            if cfg.reward.score_unfinished
            else finished_mask(out["responses"], out["response_mask"], self.tokenizer.eos_token_id)
        )
        scores = score_responses(
            self.reward_fn,
            texts,
            [gts[i] for i in rep.tolist()],
            [extras[i] for i in rep.tolist()],
            finished,
        )
        return {
            "val/reward_mean": float(scores.mean()),
            "val/exact": float((scores == 1).float().mean()),
        }

    def fit(self, log=print) -> list[dict[str, float]]:
        """Train for ``trainer.total_steps`` steps; validate every ``trainer.val_every``."""
        history = []
        t = self.cfg.trainer
        for step in range(t.total_steps):
            m = self.step(step)
            last = step + 1 == t.total_steps
            if t.val_every and ((step + 1) % t.val_every == 0 or last):
                m.update(self.validate())
            m["step"] = step + 1
            history.append(m)
            log(m)
            if t.stop_at_val_reward and m.get("val/reward_mean", 0.0) >= t.stop_at_val_reward:
                break
        return history


def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.loop.reference [key=value ...]``."""
    torch.set_num_threads(1)
    cfg = load_config(list(sys.argv[1:] if argv is None else argv))
    loop = ReferenceLoop(cfg)
    t0 = time.perf_counter()

    def log(m: dict[str, float]) -> None:
        val = f" val={m['val/reward_mean']:.3f}" if "val/reward_mean" in m else ""
        print(
            f"step {m['step']:3d} t={time.perf_counter() - t0:6.1f}s reward={m['rollout/reward_mean']:.3f}"
            f" len={m['rollout/response_length']:.2f} ent={m.get('actor/entropy', float('nan')):.2f}{val}",
            flush=True,
        )

    loop.fit(log)


if __name__ == "__main__":
    main()
