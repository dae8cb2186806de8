"""Scheduling policy: which file runs on which cards, as pure data in and out.

Nothing here starts a process or reads a file; the asyncio runner
(``gpusched.execution.runner``) applies the decisions.
"""

from gpusched.scheduling.packing import (
    Assignment,
    Decision,
    Job,
    Packer,
    Policy,
    Unschedulable,
    cpu_demand,
    largest_fitting,
)
from gpusched.scheduling.simulate import PlannedRun, simulate

__all__ = [
    "Assignment",
    "Decision",
    "Job",
    "Packer",
    "PlannedRun",
    "Policy",
    "Unschedulable",
    "cpu_demand",
    "largest_fitting",
    "simulate",
]
