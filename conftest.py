"""Root conftest: apply the NCCL loopback guard before any test module imports Ray.

It must run before Ray starts so that the raylet, and every worker it spawns,
inherit the routing variables (see trainer/netguard.py).
"""

from trainer.netguard import apply_loopback_guard

apply_loopback_guard()
