"""Dispatch modes and specs: what a worker class's dispatch table maps method names to.

Kept apart from the splitting logic (``dispatch.py``) so a worker process can
validate tables without importing tensordict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Dispatch", "DispatchSpec", "as_spec"]


class Dispatch(enum.Enum):
    """How a method's arguments reach the ranks and how results come back.

    * ``ONE_TO_ALL``: every rank gets the same arguments; returns a list, one
      result per rank.
    * ``ALL_TO_ALL``: every argument is a sequence of ``world_size`` items;
      rank ``i`` gets item ``i`` of each; returns a list, one per rank.
    * ``DP_SPLIT``: TensorDict arguments are padded to a multiple of the world
      size (repeating real rows), chunked, one chunk per rank; other arguments
      go to every rank unchanged. TensorDict results are concatenated and the
      padding removed; other results come back as a list, one per rank.
    * ``RANK_ZERO``: only rank 0 runs the method; returns its result. Methods
      that take part in collectives must not use it (the other ranks would not
      join); use ``ONE_TO_ALL`` for those.
    """

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchSpec:
    """A dispatch mode plus whether the driver waits for the result.

    With ``blocking=False`` the proxy returns at once an object whose
    ``.get()`` waits and gives what the blocking call would have returned.
    With ``resident=True`` (``DP_SPLIT`` only) TensorDict results stay in
    Ray's object store, and the call returns a handle on them
    (:class:`trainer.controller.resident.Resident`) that fetches a column
    when the driver reads it.
    """

    mode: Dispatch
    blocking: bool = True
    resident: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Dispatch):
            raise TypeError(f"DispatchSpec.mode must be a Dispatch, got {self.mode!r}")
        if not isinstance(self.blocking, bool):
            raise TypeError(f"DispatchSpec.blocking must be a bool, got {self.blocking!r}")
        if not isinstance(self.resident, bool):
            raise TypeError(f"DispatchSpec.resident must be a bool, got {self.resident!r}")
        if self.resident and self.mode is not Dispatch.DP_SPLIT:
            raise ValueError(
                f"DispatchSpec.resident needs Dispatch.DP_SPLIT (results kept in shards), "
                f"got {self.mode}"
            )


def as_spec(value: Dispatch | DispatchSpec) -> DispatchSpec:
    """Normalise a dispatch-table entry; raises ``TypeError`` for anything else."""
    if isinstance(value, DispatchSpec):
        return value
    if isinstance(value, Dispatch):
        return DispatchSpec(value)
    raise TypeError(f"expected a Dispatch or DispatchSpec, got {type(value).__name__} {value!r}")
