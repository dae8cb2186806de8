"""Ray's command line, with the time a busy machine needs for a new node to register.

``python -m rl_e2e.patient_ray start ...`` is ``ray start ...`` except that the
node it starts has ``RL_E2E_NODE_START_WAIT`` seconds (default 120) to register
with its GCS, not Ray's fixed 30 (:func:`rl_e2e.ray_startup.patient_node_start`).
Every other command and option is Ray's own.
"""

from __future__ import annotations

from rl_e2e.ray_startup import patient_node_start


def main() -> None:
    """Run Ray's CLI on this process's arguments inside the patient node start."""
    from ray.scripts.scripts import main as ray_main

    with patient_node_start():
        ray_main()


if __name__ == "__main__":
    main()
