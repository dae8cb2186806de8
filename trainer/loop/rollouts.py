"""Where a step's batch comes from: the actor's own workers, or a rollout pool ahead of the update.

:class:`ColocatedRollouts` is the synchronous trainer's source: draw the
step's prompts and generate them in the actor's workers, now.

:class:`PooledRollouts` generates on a rollout pool of its own, up to
``rollout.staleness`` batches ahead (:mod:`trainer.loop.staleness`). After
every update it pushes the actor's weights to every rollout worker, stamped
with the new policy version; the push is submitted without waiting, and Ray
runs each worker's calls in submission order, so every generation submitted
after it samples from the new weights. Its acknowledgement (version, a
fingerprint of the weights that landed, seconds) is checked when it arrives:
a wrong version is an error, a fingerprint that differs from the actor's is
reported as ``async/weights_in_sync = 0`` (a push that did nothing, or pushed
stale weights). Every batch comes back stamped with the version that
generated it; a lag beyond the bound is refused.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from tensordict import TensorDict

from trainer.config import Config
from trainer.data import batch as batch_ops
from trainer.data.prompts import PromptDataset, PromptLoader
from trainer.loop.staleness import Admission, StalenessError, check_lag
from trainer.rollout import episodes

__all__ = ["ColocatedRollouts", "DrawnPrompts", "PooledRollouts", "Rollout", "WeightPushError"]


class WeightPushError(RuntimeError):
    """A rollout worker acknowledged another policy version than the one pushed."""


@dataclass
class DrawnPrompts:
    """One step's prompts, drawn from the data order, and what the driver keeps beside them."""

    prompts: TensorDict
    """Left-padded, each prompt repeated ``rollout.n`` times in place."""
    ground_truths: list[Any]
    extras: list[dict[str, Any]]
    group_ids: torch.Tensor
    num_prompts: int
    index: int
    """The step these prompts were drawn for."""
    loader_state: dict[str, int]
    """The data position before they were drawn (where a resume draws them again)."""


@dataclass
class Rollout:
    """One step's generated batch."""

    batch: TensorDict
    drawn: DrawnPrompts
    metrics: dict[str, float] = field(default_factory=dict)
    lag: torch.Tensor | None = None
    """(B,) policy versions the actor is ahead of the one that generated each row (pools only)."""


def _draw(cfg: Config, train: PromptDataset, loader: PromptLoader, index: int) -> DrawnPrompts:
    """The next prompts of the data order, each repeated ``rollout.n`` times in place."""
    n = cfg.rollout.n
    state = loader.state_dict()
    indices = loader.next_indices()
    prompts, gts, extras = train.batch(indices)
    if cfg.rollout.multi_turn.enable:
        prompts = episodes.attach_tools_kwargs(prompts, extras)
    group_ids = batch_ops.group_ids_for(len(indices), n)
    rows = group_ids.tolist()
    return DrawnPrompts(
        batch_ops.repeat_interleave(prompts, n),
        [gts[i] for i in rows],
        [extras[i] for i in rows],
        group_ids,
        len(indices),
        index,
        state,
    )


class ColocatedRollouts:
    """The synchronous trainer's source: the actor's workers generate the step's batch."""

    def __init__(self, cfg: Config, actor: Any, train: PromptDataset, loader: PromptLoader) -> None:
        self.cfg, self.actor, self.train, self.loader = cfg, actor, train, loader

    def prepare(self, step: int) -> None:
        """Nothing to prepare: the actor's workers hold the current weights."""

    def take(self, step: int) -> Rollout:
        """Draw step ``step``'s prompts and generate them now."""
        d = _draw(self.cfg, self.train, self.loader, step)
        t0 = time.perf_counter()
        batch = self.actor.generate_sequences(d.prompts)
        return Rollout(batch, d, {"timing/gen": time.perf_counter() - t0})

    def generate(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """Generate ``prompts`` now (validation)."""
        return self.actor.generate_sequences(prompts, validation=validation)

    def after_update(self, version: int) -> None:
        """Nothing to push: the actor's workers generate from their own weights."""

    def resume_loader_state(self) -> dict[str, int]:
        """The data position a checkpoint stores."""
        return self.loader.state_dict()

    def restart(self, step: int) -> None:
        """Nothing is queued."""


@dataclass
class _Pending:
    drawn: DrawnPrompts
    call: Any
    """The pending ``generate_async`` call (``.get()`` waits)."""


class PooledRollouts:
    """Generation on a rollout pool, up to ``bound`` batches ahead of the update."""

    def __init__(
        self,
        cfg: Config,
        actor: Any,
        rollout: Any,
        train: PromptDataset,
        loader: PromptLoader,
        bound: int,
        total_steps: int,
    ) -> None:
        self.cfg, self.actor, self.rollout = cfg, actor, rollout
        self.train, self.loader = train, loader
        self.admission = Admission(bound, total_steps)
        self.queue: deque[_Pending] = deque()
        self.acks: list[tuple[int, str, float, Any]] = []
        """Pushes not yet acknowledged: (version, expected fingerprint, gather seconds, call)."""
        self.version = -1
        self.push_metrics: dict[str, float] = {}
        self.lags: list[int] = []
        """Lag of every batch taken, in order (what the staleness proofs read)."""

    # -- weights ----------------------------------------------------------------------

    def push(self, version: int) -> None:
        """Send the actor's current weights as ``version`` to every rollout worker; no waiting.

        The gather on the actor's ranks is collective and waits; the load on
        the rollout workers runs after whatever they were asked to do before.
        """
        from trainer.workers.rollout import weights_fingerprint

        t0 = time.perf_counter()
        state = self.actor.full_state_dict()[0]
        expected = weights_fingerprint(state)
        ref = ray.put(state)
        gather_s = time.perf_counter() - t0
        self.acks.append(
            (version, expected, gather_s, self.rollout.load_weights_async(ref, version))
        )
        self.version = version

    def _settle_acks(self, wait: bool) -> None:
        """Check the acknowledgements that arrived (all of them with ``wait``), oldest first."""
        while self.acks and (wait or self.acks[0][3].ready()):
            version, expected, gather_s, call = self.acks.pop(0)
            acks = call.get()
            for rank, ack in enumerate(acks):
                if ack["version"] != version:
                    raise WeightPushError(
                        f"rollout worker rank {rank} acknowledged policy version {ack['version']} "
                        f"for the push of version {version}"
                    )
            in_sync = all(ack["fingerprint"] == expected for ack in acks)
            self.push_metrics = {
                "async/push_s": gather_s + max(ack["seconds"] for ack in acks),
                "async/push_version": float(version),
                "async/weights_in_sync": float(in_sync),
                "async/prefix_cache_reset": float(all(a["prefix_cache_reset"] for a in acks)),
            }

    def prepare(self, step: int) -> None:
        """Before the first batch (or validation): push the actor's weights as version ``step``."""
        if self.version < 0:
            self.push(step)

    def after_update(self, version: int) -> None:
        """Push the new weights (the push's metrics come with a later batch)."""
        self.push(version)

    # -- batches ----------------------------------------------------------------------

    def _fill(self, step: int) -> None:
        while self.admission.may_draw(step):
            index = self.admission.draw(step)
            drawn = _draw(self.cfg, self.train, self.loader, index)
            self.queue.append(_Pending(drawn, self.rollout.generate_async(drawn.prompts)))

    def take(self, step: int) -> Rollout:
        """Step ``step``'s batch: drawn earlier (or now), waited for, its lag checked."""
        if self.version < 0:
            raise RuntimeError("PooledRollouts.take before the first push (call prepare)")
        self._fill(step)
        if not self.queue or self.queue[0].drawn.index != step:
            raise StalenessError(
                f"step {step} has no batch in the queue (next queued: "
                f"{self.queue[0].drawn.index if self.queue else 'none'})"
            )
        pending = self.queue.popleft()
        t0 = time.perf_counter()
        batch = pending.call.get()
        wait_s = time.perf_counter() - t0
        self._settle_acks(wait=False)
        versions = batch.pop("policy_version")
        lags = [check_lag(step, int(v), self.admission.bound) for v in versions.unique().tolist()]
        self.lags.append(max(lags))
        gen_s = float(batch.pop("rollout_seconds").max())
        row_lag = step - versions
        m = {
            **self.push_metrics,
            "async/lag_mean": float(row_lag.float().mean()),
            "async/lag_max": float(row_lag.max()),
            "async/queue_depth": float(len(self.queue)),
            "async/wait_s": wait_s,
            "timing/gen": gen_s,
        }
        self.push_metrics = {}
        return Rollout(batch, pending.drawn, m, row_lag)

    def generate(self, prompts: TensorDict, validation: bool = False) -> TensorDict:
        """Generate ``prompts`` on the rollout pool after everything queued (validation)."""
        self._settle_acks(wait=True)
        out = self.rollout.generate_sequences(prompts, validation=validation)
        for key in ("policy_version", "rollout_seconds", "rollout_seed", "rollout_log_probs"):
            out.pop(key, None)
        return out

    def resume_loader_state(self) -> dict[str, int]:
        """The data position of the oldest batch no step has taken: a resume draws it again."""
        return self.queue[0].drawn.loader_state if self.queue else self.loader.state_dict()

    def restart(self, step: int) -> None:
        """After a resume: nothing queued, the next batch drawn is ``step``'s."""
        self.queue.clear()
        self.admission.restart(step)
