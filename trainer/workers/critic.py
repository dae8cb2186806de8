"""The critic worker: a value model trained on GAE returns, data-parallel like the actor."""

from __future__ import annotations

from tensordict import TensorDict

from trainer import fsdp
from trainer.config import Config
from trainer.controller import Dispatch, DispatchSpec, Worker
from trainer.controller.ledger import move
from trainer.workers.actor import place_model, seed_worker
from trainer.workers.compute import compute_values, update_value
from trainer.workers.device import backend_for, worker_device
from trainer.workers.settings import value_settings
from trainer.workers.setup import build_critic, build_optimizer
from trainer.workers.state import CheckpointSaver, background_save, load_training_state


class CriticWorker(Worker):
    """Value model (the policy's backbone with a scalar token head) and its optimizer."""

    dispatch = {
        "init_model": Dispatch.ONE_TO_ALL,
        "compute_values": DispatchSpec(Dispatch.DP_SPLIT, resident=True),
        "update_critic": Dispatch.DP_SPLIT,
        "save_checkpoint": Dispatch.ONE_TO_ALL,
        "wait_checkpoint": Dispatch.ONE_TO_ALL,
        "load_checkpoint": Dispatch.ONE_TO_ALL,
    }

    def __init__(self, config: Config, model_path: str) -> None:
        super().__init__()
        self.cfg = config
        self.model_path = model_path
        self.device = worker_device(config.device_request)
        self.strategy = fsdp.resolve_strategy(
            config.critic.strategy, self.device.type, "critic.strategy"
        )

    def init_model(self) -> None:
        """Join the process group (shared with a colocated actor) and build critic + optimizer."""
        self.init_distributed(backend_for(self.device.type))
        seed_worker(self.cfg.seed, self.rank)
        self.saver = CheckpointSaver("critic", self.rank)
        c = self.cfg.critic
        critic = build_critic(self.model_path, self.cfg.seed)
        self.critic = place_model(critic, self.device, self.strategy, c.offload)
        self.optimizer, self.scheduler = build_optimizer(self.critic, c.optim)

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """``values`` (B, R) for this rank's rows."""
        gathered = fsdp.gathered_for_inference(self.critic)
        with gathered:
            v = compute_values(
                self.critic,
                move(batch, self.device),
                self.cfg.critic.micro_batch_size,
                self.cfg.critic.micro_batch_tokens,
            )
        return TensorDict({"values": move(v, "cpu")}, batch_size=batch.batch_size)

    def update_critic(self, batch: TensorDict, step: int) -> dict[str, float]:
        """Clipped value regression on this rank's shard (gradients averaged over ranks)."""
        metrics = update_value(
            self.critic, self.optimizer, move(batch, self.device), value_settings(self.cfg, step)
        )
        self.scheduler.step()
        metrics["critic/lr"] = float(self.scheduler.get_last_lr()[0])
        return metrics

    def save_checkpoint(self, directory: str, asynchronous: bool | str = False) -> bool:
        """Write this rank's shard of critic and optimizer, its RNG and the scheduler.

        As the actor's: ``auto`` follows this worker's device; returns whether the
        write runs in the background.
        """
        self.saver.save(
            directory,
            self.critic,
            self.optimizer,
            self.scheduler,
            asynchronous=background_save(asynchronous, self.device.type),
        )
        return self.saver.pending

    def wait_checkpoint(self) -> None:
        """Wait for this rank's background checkpoint write; raise if it failed."""
        self.saver.wait()

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever the saving world size."""
        load_training_state(
            directory, "critic", self.rank, self.critic, self.optimizer, self.scheduler
        )
