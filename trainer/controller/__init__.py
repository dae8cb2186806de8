"""The single controller: workers with dispatch tables, role groups, resource pools.

Everything a trainer driver needs is importable from here::

    from trainer.controller import (
        Dispatch, ResourcePool, ResourcePoolManager, Worker, create_role_groups,
    )
"""

from trainer.controller.colocation import COLOCATE_MODES, ColocateMode
from trainer.controller.errors import WorkerDiedError, WorkerError
from trainer.controller.group import PendingCall, RoleGroup, create_role_groups
from trainer.controller.modes import Dispatch, DispatchSpec
from trainer.controller.resources import (
    InfeasibleError,
    NodeResources,
    RayResourcePool,
    ResourcePool,
    ResourcePoolManager,
    check_feasible,
)
from trainer.controller.worker import Worker, WorkerContext, create_worker

__all__ = [
    "COLOCATE_MODES",
    "ColocateMode",
    "Dispatch",
    "DispatchSpec",
    "InfeasibleError",
    "NodeResources",
    "PendingCall",
    "RayResourcePool",
    "ResourcePool",
    "ResourcePoolManager",
    "RoleGroup",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "check_feasible",
    "create_role_groups",
    "create_worker",
]
