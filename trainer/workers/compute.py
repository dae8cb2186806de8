"""The model-side math of a PPO step, shared by the Ray workers and the reference loop.

Pure functions of (module, optimizer, batch, settings, process group): the
workers call them on their data-parallel shard with the dp group, the
single-process reference loop calls them on the whole batch with no group.
Same code, so the benchmark compares orchestration overhead, not two
implementations.

Batch layout (see :func:`trainer.rollout.finish_responses`): ``input_ids``,
``attention_mask``, ``position_ids`` of shape (B, P + R), ``response_mask``
(B, R); update batches add ``old_log_probs``, ``advantages`` (and
``ref_log_probs``, ``values``, ``returns`` as needed).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from trainer.algorithms import ppo_math as algos
from trainer.algorithms.mismatch import (
    add_totals,
    cap_weights,
    importance_ratios,
    importance_totals,
    mismatch_totals,
)
from trainer.data import batch as batch_ops
from trainer.workers.shared_prompt import shared_prompt_logits


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """Everything :func:`update_policy` needs besides model, optimizer and data."""

    ppo_epochs: int = 1
    num_mini_batches: int = 1
    micro_batch_size: int = 64
    """Rows per forward/backward; 0 splits by ``micro_batch_tokens`` instead."""
    micro_batch_tokens: int = 16384
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k3"
    temperature: float = 1.0
    shuffle_seed: int = 0
    share_prompt: bool = False
    """One forward per distinct prompt (see :func:`response_logits`)."""
    tis_cap: float = 0.0
    """Cap of the importance weight pi_actor / pi_rollout in the corrected loss; 0 is off."""
    tis_mode: str = "truncate"
    """truncate: weight min(ratio, tis_cap); mask: 0 above tis_cap, the ratio below."""
    tis_level: str = "token"
    """token: each token's own ratio; sequence: its response's (the product of its tokens')."""


@dataclass(frozen=True)
class ValueUpdateSettings:
    """Everything :func:`update_value` needs besides model, optimizer and data."""

    ppo_epochs: int = 1
    num_mini_batches: int = 1
    micro_batch_size: int = 64
    """Rows per forward/backward; 0 splits by ``micro_batch_tokens`` instead."""
    micro_batch_tokens: int = 16384
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    shuffle_seed: int = 0


def _response_len(batch: TensorDict) -> int:
    return batch["response_mask"].shape[1]


def micro_batches(batch: TensorDict, rows: int, tokens: int = 0) -> tuple[TensorDict, ...]:
    """Split ``batch`` for forward/backward passes: ``rows`` rows each, or by a token budget.

    With ``rows == 0`` each micro-batch holds as many rows as fit in ``tokens``
    tokens of the padded sequence length (at least one): the number of passes
    follows the work, not a row count tuned for one sequence length (verl's
    dynamic batch size, without reordering rows).
    """
    if rows < 0 or (rows == 0 and tokens < 1):
        raise ValueError(
            f"micro-batch of {rows} rows / {tokens} tokens: give rows >= 1 or tokens >= 1"
        )
    if rows == 0:
        rows = max(1, tokens // max(1, batch["input_ids"].shape[1]))
    return batch.split(rows)


_FORWARD_TAKES: dict[tuple[type, str], bool] = {}


def _forward_takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether ``model.forward`` accepts ``argument`` (looked up once per model class).

    ``logits_to_keep`` (HF): the LM head can skip prompt positions, a big share
    of a forward pass over a large vocabulary. ``past_key_values``: a pass can
    continue from a key/value cache, which the shared-prompt pass needs.
    """
    key = (type(model), argument)
    if key not in _FORWARD_TAKES:
        _FORWARD_TAKES[key] = argument in inspect.signature(model.forward).parameters
    return _FORWARD_TAKES[key]


def response_logits(
    model: torch.nn.Module, batch: TensorDict, temperature: float, share_prompt: bool = False
) -> torch.Tensor:
    """Logits (B, R, V) predicting each response token, divided by ``temperature``.

    The token at sequence position t is predicted by the logits at t - 1, so
    the response's predictions are positions P - 1 .. P + R - 2. With
    ``share_prompt`` (and a model that takes a key/value cache) each distinct
    prompt is computed once (:mod:`trainer.workers.shared_prompt`).
    """
    if (
        share_prompt
        and _forward_takes(model, "logits_to_keep")
        and _forward_takes(model, "past_key_values")
    ):
        logits = shared_prompt_logits(model, batch).float()
    else:
        r = _response_len(batch)
        kwargs = {"logits_to_keep": r + 1} if _forward_takes(model, "logits_to_keep") else {}
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **kwargs,
        )
        logits = out.logits[:, -r - 1 : -1, :].float()
    if temperature > 0:
        logits = logits / temperature
    return logits


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] = logit[token] - logsumexp(logits), for every position.

    Never materialises the (B, R, V) log-softmax: one reduction and one gather.
    """
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def compute_log_probs(
    model: torch.nn.Module,
    batch: TensorDict,
    temperature: float,
    micro_batch_size: int,
    micro_batch_tokens: int = 0,
    share_prompt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies (B, R) of the batch's responses, no grad."""
    was_training = model.training
    model.eval()
    try:
        lps, ents = [], []
        for mb in micro_batches(batch, micro_batch_size, micro_batch_tokens):
            logits = response_logits(model, mb, temperature, share_prompt)
            lps.append(token_log_probs(logits, mb["responses"]))
            ents.append(algos.entropy_from_logits(logits))
    finally:
        model.train(was_training)
    return torch.cat(lps), torch.cat(ents)


def critic_token_values(critic: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """V(s_t) (B, R): the value head read at the position before each response token."""
    r = _response_len(batch)
    out = critic(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    return out.logits[:, -r - 1 : -1, 0].float() * batch["response_mask"]


@torch.no_grad()
def compute_values(
    critic: torch.nn.Module, batch: TensorDict, micro_batch_size: int, micro_batch_tokens: int = 0
) -> torch.Tensor:
    """Values (B, R) of the batch's response positions, no grad."""
    was_training = critic.training
    critic.eval()
    try:
        return torch.cat(
            [
                critic_token_values(critic, mb)
                for mb in micro_batches(batch, micro_batch_size, micro_batch_tokens)
            ]
        )
    finally:
        critic.train(was_training)


def allreduce_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Average gradients over the data-parallel group with one flat all-reduce.

    A no-op when torch.distributed is not initialised (the reference loop) and
    for FSDP2-sharded parameters (DTensors), whose gradients FSDP2 reduces itself.
    Parameters without a gradient contribute zeros, so every rank sends the
    same shapes.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if any(isinstance(p, DTensor) for p in params):
        return  # FSDP2 already reduce-scattered (averaged) these gradients in backward
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= world
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip in place; the total norm as a plain tensor (over all shards for FSDP2)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _mini_batches(batch: TensorDict, num_mini_batches: int, seed: int) -> list[TensorDict]:
    """Shuffle (seeded, so reproducible) and split into ``num_mini_batches`` equal parts."""
    n = batch.batch_size[0]
    if n % num_mini_batches:
        raise ValueError(
            f"local batch of {n} rows does not split into {num_mini_batches} mini-batches; "
            "the driver pads the batch so this cannot happen"
        )
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen, device="cpu").to(batch_ops.device_of(batch))
    return list(batch[perm].split(n // num_mini_batches))


def _mean_metrics(acc: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(sum(v) / len(v)) for k, v in acc.items() if v}


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TensorDict,
    s: PolicyUpdateSettings,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """PPO epochs x mini-batches x micro-batches on this rank's shard; one optimizer step per mini-batch.

    Loss normalisation is global (:func:`trainer.algorithms.ppo_math.agg_norm` over the whole
    mini-batch on all dp ranks), so the parameters after a step do not depend on
    the micro-batch size or the number of ranks.

    A batch without ``old_log_probs`` is allowed for one on-policy pass (one
    epoch, one mini-batch): the policy that sampled is the one being updated,
    so the old log-probs are the current ones, detached, and the driver skips
    a whole forward pass over the batch. The entropy it would have reported
    then comes back as ``actor/entropy``, and, when the batch carries the
    engine's ``rollout_log_probs``, the engine/actor mismatch totals
    (:mod:`trainer.algorithms.mismatch`) measured on that same forward, before
    the optimizer step.

    The corrected (decoupled) loss: the clip is taken against ``old_log_probs``
    (the proximal policy) and, with ``s.tis_cap > 0``, each token's clipped
    loss is weighted by the ratio of the proximal policy over the engine's
    (``rollout_log_probs``, the behaviour policy), capped as ``s.tis_mode``
    says (:func:`~trainer.algorithms.mismatch.cap_weights`), the ratio being the
    token's own or its response's as ``s.tis_level`` says; padding weighs 0.
    Whenever the batch carries ``rollout_log_probs`` the weights' totals
    (:func:`~trainer.algorithms.mismatch.importance_totals`, each token once:
    first epoch) come back with the metrics, applied or not.
    """
    on_policy = "old_log_probs" not in batch.keys()
    if on_policy and (s.ppo_epochs != 1 or s.num_mini_batches != 1):
        raise ValueError(
            "batch has no old_log_probs: that is only valid for one on-policy pass "
            f"(ppo_epochs=1 and one mini-batch), got ppo_epochs={s.ppo_epochs} and "
            f"{s.num_mini_batches} mini-batches"
        )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    acc: dict[str, list[float]] = defaultdict(list)
    engine_lp = "rollout_log_probs" in batch.keys()
    if s.tis_cap > 0 and not engine_lp:
        raise ValueError(
            f"tis_cap={s.tis_cap} weights the loss by the engine's log-probs, "
            "but the batch has no rollout_log_probs"
        )
    totals: dict[str, float] = {}
    for epoch in range(s.ppo_epochs):
        for mini in _mini_batches(batch, s.num_mini_batches, s.shuffle_seed * 1000 + epoch):
            norm = algos.agg_norm(mini["response_mask"], s.loss_agg_mode, group=group)
            optimizer.zero_grad(set_to_none=True)
            # Micro-batch losses are shares of the mini-batch loss: sum them.
            mini_loss = 0.0
            for micro in micro_batches(mini, s.micro_batch_size, s.micro_batch_tokens):
                mask = micro["response_mask"]
                logits = response_logits(model, micro, s.temperature, s.share_prompt)
                log_prob = token_log_probs(logits, micro["responses"])
                if on_policy:
                    old_log_prob = log_prob.detach()
                    if mask.any():  # padding rows carry no tokens
                        with torch.no_grad():
                            ent = algos.entropy_from_logits(logits)
                            acc["actor/entropy"].append(
                                algos.aggregate(ent, mask, "token-mean").item()
                            )
                else:
                    old_log_prob = micro["old_log_probs"]
                if on_policy and engine_lp:
                    piece = mismatch_totals(log_prob, micro["rollout_log_probs"], mask)
                    totals = add_totals(totals, piece)
                weights = None
                if engine_lp:
                    ratios = importance_ratios(
                        old_log_prob, micro["rollout_log_probs"], mask, s.tis_level
                    )
                    capped = cap_weights(ratios, s.tis_cap, s.tis_mode) if s.tis_cap > 0 else ratios
                    if epoch == 0:
                        piece = importance_totals(ratios, capped, mask, s.tis_cap)
                        totals = add_totals(totals, piece)
                    if s.tis_cap > 0:
                        weights = capped
                pg_loss, pg_metrics = algos.policy_loss(
                    old_log_prob,
                    log_prob,
                    micro["advantages"],
                    mask,
                    clip_low=s.clip_low,
                    clip_high=s.clip_high,
                    clip_c=s.clip_c,
                    agg=s.loss_agg_mode,
                    norm=norm,
                    token_weights=weights,
                )
                loss = pg_loss
                if s.entropy_coeff != 0:
                    entropy = algos.entropy_from_logits(logits)
                    ent_loss = algos.aggregate(entropy, mask, s.loss_agg_mode, norm=norm)
                    loss = loss - s.entropy_coeff * ent_loss
                if s.use_kl_loss:
                    kl = algos.kl_penalty(log_prob, micro["ref_log_probs"], s.kl_loss_type)
                    kl_loss = algos.aggregate(kl, mask, s.loss_agg_mode, norm=norm)
                    loss = loss + s.kl_loss_coef * kl_loss
                    acc["actor/kl_loss"].append(kl_loss.item())
                loss.backward()
                mini_loss += pg_loss.item()
                for k, v in pg_metrics.items():
                    acc[f"actor/{k}"].append(float(v))
            acc["actor/pg_loss"].append(mini_loss)
            allreduce_gradients(params, group)
            grad_norm = _clip_grad_norm(params, s.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            acc["actor/grad_norm"].append(grad_norm.item())
    return {**_mean_metrics(acc), **totals}


def update_value(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TensorDict,
    s: ValueUpdateSettings,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Clipped value regression on ``returns``, with the same global aggregation as the policy."""
    critic.train()
    params = [p for p in critic.parameters() if p.requires_grad]
    acc: dict[str, list[float]] = defaultdict(list)
    for epoch in range(s.ppo_epochs):
        for mini in _mini_batches(batch, s.num_mini_batches, s.shuffle_seed * 1000 + epoch):
            norm = algos.agg_norm(mini["response_mask"], s.loss_agg_mode, group=group)
            optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for micro in micro_batches(mini, s.micro_batch_size, s.micro_batch_tokens):
                values = critic_token_values(critic, micro)
                vf_loss, vf_metrics = algos.value_loss(
                    values,
                    micro["values"],
                    micro["returns"],
                    micro["response_mask"],
                    clip=s.cliprange_value,
                    agg=s.loss_agg_mode,
                    norm=norm,
                )
                vf_loss.backward()
                mini_loss += vf_loss.item()
                for k, v in vf_metrics.items():
                    acc[f"critic/{k}"].append(float(v))
            acc["critic/vf_loss"].append(mini_loss)
            allreduce_gradients(params, group)
            grad_norm = _clip_grad_norm(params, s.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            acc["critic/grad_norm"].append(grad_norm.item())
    return _mean_metrics(acc)
