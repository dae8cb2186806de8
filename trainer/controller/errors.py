"""Errors a worker group raises on the driver."""

from __future__ import annotations

__all__ = ["InputLostError", "WorkerDiedError", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker method raised; carries the role, rank, method and remote traceback."""

    def __init__(self, role: str, rank: int, method: str, remote_traceback: str) -> None:
        super().__init__(role, rank, method, remote_traceback)
        self.role = role
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        return (
            f"{self.role}.{self.method} failed on rank {self.rank} (role {self.role!r}); "
            f"remote traceback:\n{self.remote_traceback.rstrip()}"
        )


class InputLostError(WorkerError):
    """A worker's input was lost with the process that held it (Ray's ``ObjectLostError``).

    The failure is that other process's: a rollout worker that died while an
    actor still had to read the batch it made, say. The driver looks for that
    death before reporting this error (:meth:`trainer.loop.ppo.PPOTrainer.fit`).
    The driver's own read of such a batch raises it too, with role ``"driver"``
    (:class:`trainer.controller.resident.Resident`).
    """


class WorkerDiedError(RuntimeError):
    """A worker process died (crash, ``os._exit``, OOM kill) during a call."""

    def __init__(self, role: str, rank: int, method: str, detail: str) -> None:
        super().__init__(role, rank, method, detail)
        self.role = role
        self.rank = rank
        self.method = method
        self.detail = detail

    def __str__(self) -> str:
        return (
            f"the process of rank {self.rank} (role {self.role!r}) died during "
            f"{self.role}.{self.method}; the group is unusable, create a new one. "
            f"Ray said: {self.detail}"
        )
