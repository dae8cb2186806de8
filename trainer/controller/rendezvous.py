"""Where a worker group's ranks meet: rank 0's port and the default backend.

Rank 0 of a worker group binds its ``torch.distributed`` store on a port that
its host picked a moment before (:func:`free_port`); the group's ranks live in
Ray actors, possibly on other nodes, so the driver cannot hold the store for
them as ``rl_e2e.distributed`` does for local ranks.
"""

from __future__ import annotations

from rl_e2e.ports import quiet_ports

__all__ = ["default_backend", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Outside the kernel's ephemeral range (:func:`rl_e2e.ports.quiet_ports`): the
    other actors of the group start before rank 0 binds it, and meanwhile every
    ``connect()`` on the node is handed an ephemeral port.
    """
    (port,) = quiet_ports(1, host)
    return port


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``: only outside a Ray grant.

    Workers in Ray actors take their backend from what Ray granted
    (``trainer.controller.grant.granted_backend``); this is the fallback for a
    worker built outside Ray.
    """
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
