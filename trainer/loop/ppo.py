"""The single-controller PPO/GRPO driver.

Top half: the driver-side math of a step as pure functions (rewards to token
rewards, KL shaping, advantages, diagnostics), shared with
:mod:`trainer.loop.reference`. Bottom half: :class:`PPOTrainer`, whose ``fit``
reads like CleanRL's loop: generate -> reward -> old/ref log-probs -> values
-> advantages -> critic update -> actor update -> validate -> log/checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

from trainer.algorithms import mismatch as rollout_mismatch
from trainer.algorithms import ppo_math as algos
from trainer.checkpoints import rng
from trainer.config import Config
from trainer.controller.errors import InputLostError
from trainer.controller.group import DEATH_GRACE_S
from trainer.controller.ledger import Ledger, tensor_bytes
from trainer.controller.resident import Resident
from trainer.data import batch as batch_ops
from trainer.data.prompts import PromptDataset, PromptLoader
from trainer.data.rewards import RewardFn, score
from trainer.loop.rollouts import ColocatedRollouts, PooledRollouts
from trainer.placement import colocation_mode, pool_count
from trainer.rollout import episodes

#: Peaks are reported as the largest over data-parallel ranks, not their mean.
PEAK_ACROSS_RANKS = {"perf/peak_rss_gb": "max", "perf/max_memory_allocated_gb": "max"}


def score_responses(
    reward_fn: RewardFn,
    completions: list[str],
    ground_truths: list[str],
    extras: list[dict],
    finished: torch.Tensor | None = None,
) -> torch.Tensor:
    """One scalar reward per response, each checked to lie in [0, 1].

    With ``finished`` given, responses that did not finish (cut at the length
    limit without EOS) score 0 without calling the reward function: an answer
    that never stopped is not an answer (``reward.score_unfinished=true`` turns
    this off).
    """
    done = [True] * len(completions) if finished is None else finished.tolist()
    return torch.tensor(
        [
            score(reward_fn, c, g, **e) if ok else 0.0
            for c, g, e, ok in zip(completions, ground_truths, extras, done, strict=True)
        ],
        dtype=torch.float32,
    )


def finished_mask(
    responses: torch.Tensor, response_mask: torch.Tensor, eos_token_id: int
) -> torch.Tensor:
    """True for responses that ended with EOS within the length limit."""
    return ((responses == eos_token_id) & response_mask.bool()).any(dim=1)


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last response token (zeros elsewhere).

    The last token is the last position of the mask, which need not be its
    sum minus one: multi-turn masks have holes where tool results sit.
    """
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device).expand_as(
        response_mask
    )
    last = (positions * response_mask.bool()).max(dim=1).values - 1
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = scores.to(out.device)[rows]
    return out


def apply_kl_in_reward(
    token_rewards: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str,
    coef: float,
) -> tuple[torch.Tensor, float]:
    """``r_t - coef * KL_t`` on response tokens; also returns the mean per-sequence KL."""
    kl = algos.kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask
    seq_kl = kl.sum(dim=1)
    valid = response_mask.sum(dim=1) > 0
    mean_kl = float(seq_kl[valid].mean()) if valid.any() else 0.0
    return token_rewards - coef * kl, mean_kl


def compute_advantages(
    algo: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None,
    gamma: float,
    lam: float,
    grpo_std_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for ``algo`` (the estimators live in :mod:`trainer.algorithms.ppo_math`)."""
    if algo == "gae":
        if values is None:
            raise ValueError("algo=gae needs critic values")
        return algos.gae_advantages(token_rewards, values, response_mask, gamma, lam)
    if algo in ("grpo", "grpo_no_std"):
        return algos.grpo_advantages(
            token_rewards, response_mask, group_ids, norm_by_std=algo == "grpo", eps=grpo_std_eps
        )
    if algo == "rloo":
        return algos.rloo_advantages(token_rewards, response_mask, group_ids)
    if algo == "reinforce_pp":
        return algos.reinforce_pp_advantages(token_rewards, response_mask, gamma)
    raise ValueError(f"algo={algo!r}: unknown advantage estimator")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over masked tokens (nan when Var[returns] = 0)."""
    m = mask.bool()
    y, v = returns[m], values[m]
    if y.numel() < 2:
        return float("nan")
    var_y = torch.var(y)
    return float("nan") if var_y == 0 else float(1 - torch.var(y - v) / var_y)


def needs_old_log_prob_pass(cfg: Config) -> bool:
    """Whether a step needs a separate forward pass for the sampling policy's log-probs.

    Not for one on-policy pass (one epoch, one mini-batch, as TRL's GRPO with
    ``num_iterations=1``): the update's own forward gives them, detached (see
    :func:`trainer.workers.compute.update_policy`). A KL penalty in the reward
    needs them before the advantages, so it keeps the pass.
    """
    one_pass = (
        cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    )
    return not one_pass or cfg.algorithm.use_kl_in_reward


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over ``mask`` (0.0 when empty)."""
    m = mask.bool()
    return float(x[m].mean()) if m.any() else 0.0


def response_length(cfg) -> int:
    """``rollout.max_response_length``, or the synthetic task's default when 0."""
    from trainer.data.tasks import get_task

    if cfg.rollout.max_response_length:
        return int(cfg.rollout.max_response_length)
    return get_task(cfg.data.task).max_response_length if not cfg.data.train_files else 64


def resolve_reward_fn(cfg) -> RewardFn:
    """``reward.function`` if set; else the synthetic task's rule, or exact match for files."""
    from trainer.data.rewards import exact_match, load_reward_fn
    from trainer.data.tasks import get_task

    if cfg.reward.function:
        return load_reward_fn(cfg.reward.function)
    return exact_match if cfg.data.train_files else get_task(cfg.data.task).reward


def decode_responses(
    tokenizer,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Response text without its final EOS: what the reward function reads.

    By default special tokens are dropped from the text, as TRL and verl
    decode before scoring (``reward.skip_special_tokens=true``): the reward
    means the same here as there. With ``skip_special_tokens=False`` they stay
    in the text, so a policy that pads or emits role markers between digits
    does not read as clean text.
    """
    eos = tokenizer.eos_token_id
    seqs = []
    for r, m in zip(responses, response_mask, strict=True):
        toks = r[m.bool()].tolist()
        if toks and toks[-1] == eos:
            toks = toks[:-1]
        seqs.append(toks)
    return tokenizer.batch_decode(seqs, skip_special_tokens=skip_special_tokens)


def plan_on_cluster(cfg: Config, pools: int = 1) -> None:
    """Settle ``trainer.device=auto`` and ``trainer.num_workers=0`` from the running Ray cluster.

    The cluster, not this process's CUDA, decides: ``auto`` trains on CUDA when
    the cluster offers GPUs (see :func:`trainer.workers.device.plan_devices`).
    The decision is written back into ``cfg`` (``trainer.use_gpu``,
    ``trainer.num_workers``), so calling this again changes nothing.
    """
    import ray

    from trainer.workers.device import plan_devices

    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    # On cards, every rollout worker holds one of its own: the training pools get the rest.
    gpus = max(0.0, gpus - cfg.rollout_pool_workers) if gpus >= 1 else gpus
    plan = plan_devices(cfg.device_request, gpus, cfg.trainer.num_workers, pools)
    cfg.trainer.use_gpu = plan.use_gpu
    cfg.trainer.num_workers = plan.num_workers


def build_worker_groups(
    cfg: Config,
    model_path: str,
    max_new_tokens: int,
    *,
    colocate: bool | None = None,
    rollout_cls: type | None = None,
) -> dict[str, Any]:
    """Start the role groups on the running Ray cluster: actor (+ critic) (+ rollout).

    First settles the device and the worker count from the cluster
    (:func:`plan_on_cluster`).

    Each training pool has ``trainer.num_workers / trainer.nnodes`` processes
    on each of ``trainer.nnodes`` distinct nodes.

    ``trainer.colocate`` says where the critic (GAE only) lives:
    ``process`` (what ``python -m trainer`` does): one pool of
    ``trainer.num_workers`` processes; actor and critic share those processes
    and their gloo group. ``actor``: the critic gets processes of its own on
    the same bundles, each role asking Ray for half of every bundle (the
    fractional GPU share of verl-style colocation). ``none``: the critic gets a
    pool of its own, as many processes again. ``colocate=False`` overrides the
    config with ``none``.

    With ``rollout.workers >= 1`` (or ``rollout.staleness >= 1``) a ``rollout``
    group of that many :class:`~trainer.workers.rollout.RolloutWorker`
    (``rollout_cls``, a subclass for tests) gets a pool of its own.
    """
    from trainer.controller import ResourcePool, ResourcePoolManager, create_role_groups
    from trainer.workers import ActorRolloutRefWorker, CriticWorker
    from trainer.workers.rollout import RolloutWorker

    mode = colocation_mode(cfg, colocate)
    plan_on_cluster(cfg, pools=pool_count(cfg, colocate))

    def pool() -> ResourcePool:
        nodes = cfg.trainer.nnodes
        per_node = [cfg.trainer.num_workers // nodes] * nodes
        return ResourcePool(per_node, use_gpu=cfg.trainer.use_gpu)

    pools = {"train": pool()}
    roles = {"actor": "train"}
    actor_kwargs = {"config": cfg, "model_path": model_path, "max_new_tokens": max_new_tokens}
    specs: dict[str, Any] = {"actor": (ActorRolloutRefWorker, actor_kwargs)}
    if cfg.use_critic:
        roles["critic"] = "critic" if mode == "none" else "train"
        if mode == "none":
            pools["critic"] = pool()
        specs["critic"] = (CriticWorker, {"config": cfg, "model_path": model_path})
    if cfg.rollout_pool_workers:
        pools["rollout"] = ResourcePool([cfg.rollout_pool_workers], use_gpu=cfg.trainer.use_gpu)
        roles["rollout"] = "rollout"
        specs["rollout"] = (rollout_cls or RolloutWorker, actor_kwargs)
    manager = ResourcePoolManager(pools, roles)
    return create_role_groups(manager, specs, colocate="actor" if mode == "actor" else "process")


def shutdown_worker_groups(groups: dict[str, Any]) -> None:
    """Kill the groups' processes and release their placement groups."""
    pools = {}
    for group in groups.values():
        group.shutdown()
        pools[id(group.pool)] = group.pool
    for pool in pools.values():
        pool.release()


def make_kl_controller(cfg: Config) -> algos.FixedKLController | algos.AdaptiveKLController:
    """The KL coefficient controller named by ``algorithm.kl_ctrl``."""
    a = cfg.algorithm
    if a.kl_ctrl == "adaptive":
        return algos.AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon)
    return algos.FixedKLController(a.kl_coef)


def pad_for_update(batch: TensorDict | Resident, divisor: int) -> TensorDict | Resident:
    """Pad to a multiple of ``divisor`` rows with rows that carry no loss.

    The padding rows copy real rows (so every tensor is well formed) but have
    an all-zero ``response_mask`` and zero advantages: global aggregation
    ignores them, so a batch the data-parallel size does not divide trains
    exactly like the unpadded one.
    """
    if isinstance(batch, Resident):  # padded where each rank reads its rows
        return batch.padded(divisor, zero=("response_mask", "advantages"))
    padded, pad = batch_ops.pad_to_divisor(batch, divisor)
    if pad:
        n = batch.batch_size[0]
        padded["response_mask"][n:] = 0
        padded["advantages"][n:] = 0
    return padded


@contextmanager
def _timed(metrics: dict[str, float], key: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing/{key}"] = time.perf_counter() - t0


class PPOTrainer:
    """The single controller: holds the schedule of an RL step; workers do the compute.

    ``actor`` and ``critic`` are role groups (or anything with the same
    methods): ``actor.generate_sequences``, ``compute_log_prob``,
    ``compute_ref_log_prob``, ``update_actor``; ``critic.compute_values``,
    ``update_critic``. DP_SPLIT methods take the whole batch and return it
    whole; metrics come back one dict per rank.

    The step's batch is a TensorDict or, from Ray workers, a resident batch
    (:class:`~trainer.controller.resident.Resident`): its columns stay with
    the workers and in Ray's object store, ``batch[key]`` fetches one when
    the driver's math needs it, ``batch[key] = value`` puts one the driver
    made, ``batch.update(result)`` joins a call's result where it lies. So
    each tensor crosses the driver at most once a step.
    """

    def __init__(
        self,
        cfg: Config,
        actor: Any,
        critic: Any | None,
        tokenizer: Any,
        train: PromptDataset,
        val: PromptDataset,
        reward_fn: RewardFn,
        max_new_tokens: int,
        world_size: int,
        rollout: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor, self.critic = actor, critic
        self.tokenizer = tokenizer
        self.train, self.val = train, val
        self.reward_fn = reward_fn
        self.max_new_tokens = max_new_tokens
        self.world_size = world_size
        self.loader = PromptLoader(
            len(train), cfg.data.train_batch_size, cfg.seed, cfg.data.shuffle
        )
        self.rollouts: ColocatedRollouts | PooledRollouts
        """Where batches come from: the actor's workers, or the ``rollout`` pool's."""
        if rollout is None:
            self.rollouts = ColocatedRollouts(cfg, actor, train, self.loader)
        else:
            self.rollouts = PooledRollouts(
                cfg,
                actor,
                rollout,
                train,
                self.loader,
                cfg.rollout.staleness,
                cfg.trainer.total_steps,
            )
        self.kl_ctrl = make_kl_controller(cfg)
        self.calls = Ledger()
        """What each step's worker calls cost the driver (``timing/controller``, ``perf/driver_bytes``)."""
        self.multi_turn = cfg.rollout.multi_turn.enable
        self.trajectory_log: episodes.TrajectoryLog | None = None
        """Set by the caller that owns a run directory (``python -m trainer``)."""
        self.step = 0
        mini = [cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size]
        if cfg.use_critic:
            mini.append(cfg.data.train_batch_size // cfg.critic.ppo_mini_batch_size)
        self.update_divisor = world_size * math.lcm(*mini)

    # ----------------------------------------------------------------- one step

    def train_step(self) -> dict[str, float]:
        """One PPO iteration: rollout, rewards, advantages, critic and actor updates."""
        cfg, n, m = self.cfg, self.cfg.rollout.n, {}
        step = self.step
        t_start = time.perf_counter()
        self.calls.start()  # the controller's cost: every worker call of this step

        # 1. rollout: n samples per prompt (generated now, or queued on the rollout pool)
        self.rollouts.prepare(step)
        ro = self.rollouts.take(step)
        m.update(ro.metrics)
        batch, gts, extras = ro.batch, ro.drawn.ground_truths, ro.drawn.extras
        group_ids = ro.drawn.group_ids
        mask = batch["response_mask"]

        # 2. rewards from the rule (or user function) on the decoded text
        with _timed(m, "reward"):
            texts, extras = self._reward_inputs(batch, extras, m, "rollout")
            scores = score_responses(self.reward_fn, texts, gts, extras, self._finished(batch))
            token_rewards = token_level_rewards(scores, mask)

        # 3. log-probs under the policy that sampled (unless the update's own
        #    forward gives them: one on-policy pass), the reference's, values
        lp = None
        mismatch: dict[str, float] = {}
        if needs_old_log_prob_pass(cfg):
            with _timed(m, "old_log_prob"):
                lp = self.actor.compute_log_prob(batch)
            batch.update(lp.select("old_log_probs"))
            if "rollout_log_probs" in batch.keys():
                mismatch = rollout_mismatch.mismatch_totals(
                    lp["old_log_probs"], batch["rollout_log_probs"], mask
                )
                if ro.lag is not None:
                    m.update(
                        rollout_mismatch.mismatch_by_lag(
                            lp["old_log_probs"], batch["rollout_log_probs"], mask, ro.lag
                        )
                    )
        if cfg.use_reference:
            with _timed(m, "ref"):
                batch.update(self.actor.compute_ref_log_prob(batch).select("ref_log_probs"))
        if cfg.algorithm.use_kl_in_reward:
            token_rewards, seq_kl = apply_kl_in_reward(
                token_rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                mask,
                cfg.algorithm.kl_penalty,
                self.kl_ctrl.value,
            )
            m["actor/reward_kl"], m["actor/kl_coef"] = seq_kl, float(self.kl_ctrl.value)
            self.kl_ctrl.update(seq_kl, ro.drawn.num_prompts * n)
        values = None
        if self.critic is not None:
            with _timed(m, "values"):
                batch.update(self.critic.compute_values(batch).select("values"))
            values = batch["values"]

        # 4. advantages on the driver
        with _timed(m, "adv"):
            adv, returns = compute_advantages(
                cfg.algo,
                token_rewards,
                mask,
                group_ids,
                values,
                cfg.algorithm.gamma,
                cfg.algorithm.lam,
                cfg.algorithm.grpo_std_eps,
            )
        batch["advantages"], batch["returns"] = adv, returns
        update_batch = pad_for_update(batch, self.update_divisor)

        # 5. critic update, then actor update once the critic has warmed up
        if self.critic is not None:
            with _timed(m, "update_critic"):
                m.update(batch_ops.merge_metrics(self.critic.update_critic(update_batch, step)))
            m["critic/explained_variance"] = explained_variance(values, returns, mask)
            m["critic/values_mean"] = masked_mean(values, mask)
            m["critic/returns_mean"] = masked_mean(returns, mask)
        if step >= cfg.critic.warmup_steps:
            with _timed(m, "update_actor"):
                per_rank = self.actor.update_actor(update_batch, step)
                reduce = {**PEAK_ACROSS_RANKS, **rollout_mismatch.TOTALS_REDUCE}
                reduce = {k: v for k, v in reduce.items() if k in per_rank[0]}
                merged = batch_ops.merge_metrics(per_rank, reduce=reduce)
                # The update's own forward measured the mismatch when it was the one
                # on-policy pass; otherwise the old-log-prob pass above did. The
                # importance weights' totals always come from the update.
                mismatch = {**rollout_mismatch.pop_totals(merged), **mismatch}
                m.update(merged)
        m.update(rollout_mismatch.mismatch_metrics(mismatch))
        m.update(rollout_mismatch.importance_metrics(mismatch))
        # 6. the rollout pool (if any) gets the new weights before it generates again
        self.rollouts.after_update(step + 1)

        elapsed = time.perf_counter() - t_start
        self.calls.stop()
        m.update(self.calls.metrics(elapsed))
        m["perf/batch_bytes"] = float(tensor_bytes(batch))
        n_tokens = int(mask.sum())
        m.update(
            {
                "rollout/reward_mean": float(scores.mean()),
                "rollout/reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
                "rollout/exact": float((scores == 1).float().mean()),
                "rollout/response_length": float(mask.sum(1).float().mean()),
                "actor/advantages_mean": masked_mean(adv, mask),
                "timing/step": elapsed,
                "perf/tokens_per_s": n_tokens / max(elapsed, 1e-9),
                "perf/response_tokens": float(n_tokens),
            }
        )
        if "async/wait_s" in m:
            m["async/trainer_idle_frac"] = min(1.0, m["async/wait_s"] / max(elapsed, 1e-9))
            busy = m["timing/gen"] + m.get("async/push_s", 0.0)
            m["async/rollout_idle_frac"] = max(0.0, 1.0 - busy / max(elapsed, 1e-9))
        if lp is not None:
            m["actor/entropy"] = masked_mean(lp["entropy"], mask)
        m.update(self.train.metrics("rollout"))
        self.step += 1
        return m

    def validate(self) -> dict[str, float]:
        """Mean reward over the validation prompts at ``rollout.val_temperature``."""
        vn = self.cfg.rollout.val_n
        t0 = time.perf_counter()
        prompts, gts, extras = self.val.batch(range(len(self.val)))
        if self.multi_turn:
            prompts = episodes.attach_tools_kwargs(prompts, extras)
        rep = batch_ops.group_ids_for(len(self.val), vn).tolist()
        self.rollouts.prepare(self.step)
        out = self.rollouts.generate(batch_ops.repeat_interleave(prompts, vn), validation=True)
        m: dict[str, float] = {}
        texts, val_extras = self._reward_inputs(out, [extras[i] for i in rep], m, "val")
        scores = score_responses(
            self.reward_fn, texts, [gts[i] for i in rep], val_extras, self._finished(out)
        )
        if self.multi_turn and self.trajectory_log is not None:
            records = episodes.episode_records(out)
            self.trajectory_log.write(self.step, "val", records, scores.tolist())
        return {
            **m,
            "val/reward_mean": float(scores.mean()),
            "val/exact": float((scores == 1).float().mean()),
            "timing/val": time.perf_counter() - t0,
        }

    def _reward_inputs(
        self, batch: TensorDict, extras: list[dict], m: dict[str, float], prefix: str
    ) -> tuple[list[str], list[dict]]:
        """Texts and extras for the reward function; multi-turn adds the trajectory and metrics."""
        if not self.multi_turn:
            texts = decode_responses(
                self.tokenizer,
                batch["responses"],
                batch["response_mask"],
                self.cfg.reward.skip_special_tokens,
            )
            return texts, extras
        records = episodes.episode_records(batch)
        m.update(episodes.episode_metrics(records, prefix))
        return episodes.reward_inputs(records, extras)

    def _finished(self, batch: TensorDict) -> torch.Tensor | None:
        if self.cfg.reward.score_unfinished:
            return None
        if "finished" in batch.keys():  # multi-turn: the last turn ended with EOS
            return batch["finished"].bool()
        return finished_mask(
            batch["responses"], batch["response_mask"], self.tokenizer.eos_token_id
        )

    # ----------------------------------------------------------------- the loop

    def fit(
        self, on_step: Callable[[int, dict[str, float]], None] | None = None
    ) -> list[dict[str, float]]:
        """Train from ``self.step`` to ``trainer.total_steps``.

        After each step: validate every ``trainer.val_every`` steps (and after
        the last), then ``on_step(step, metrics)`` (logging, checkpoints).
        Stops early once validation reward reaches ``trainer.stop_at_val_reward``.
        """
        t = self.cfg.trainer
        history = []
        if t.val_before_train and self.step == 0:
            first = self.validate()
            if on_step is not None:
                on_step(0, first)
        while self.step < t.total_steps:
            try:
                metrics = self.train_step()
            except InputLostError as lost:  # the process that held the input is the failure
                died = self.rollouts.death_meanwhile(DEATH_GRACE_S)
                if died is None:
                    raise
                raise died from lost
            done = self.step == t.total_steps
            if t.val_every and (self.step % t.val_every == 0 or done):
                metrics.update(self.validate())
            history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
            if (
                t.stop_at_val_reward
                and metrics.get("val/reward_mean", -1.0) >= t.stop_at_val_reward
            ):
                break
        return history

    # ----------------------------------------------------------------- checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """Driver state for a checkpoint, JSON-able: step, data position, KL controller, RNG states."""
        return {
            "step": self.step,
            "loader": self.rollouts.resume_loader_state(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "rng": rng.capture(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        self.rollouts.restart(self.step)
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        rng.restore(state["rng"])
