"""Deadlines in tests are hang guards, never speed checks.

A test waits for the event it needs (a subprocess's exit, every rank's result, an
agent that registered); its deadline only ends a wait that would otherwise never
end, so that a hang fails with the output of what hung. The same work takes
several times longer on a loaded machine (a CI runner whose cores are shared,
files running side by side under gpusched, a second job beside the suite), so a
guard is the bound the work keeps on a quiet machine times ``PATIENCE``: it fires
on a hang, not on a slow machine. gpusched's per-file ``--timeout`` is the outer
bound of the whole file.

Tests of a timeout itself (a tool call cut off after 0.3 s, a rank that never
returns) pass their small figures directly: there the deadline is the behaviour
under test, not a guard.
"""

from __future__ import annotations

import time

PATIENCE = 5.0


def hang_guard(quiet_bound_s: float) -> float:
    """Seconds to wait for work that ends within ``quiet_bound_s`` on a quiet machine."""
    return quiet_bound_s * PATIENCE


def wait_until(predicate, quiet_bound_s: float, what: str, poll_s: float = 0.1):
    """Poll ``predicate`` until it returns something true, and return that.

    Raises ``AssertionError`` naming ``what`` after ``hang_guard(quiet_bound_s)``.
    """
    deadline = time.monotonic() + hang_guard(quiet_bound_s)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
