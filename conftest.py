"""Root conftest: this repository's tests use the e2e plugin as any RL repository would.

The plugin applies the NCCL loopback guard when pytest starts, before any test
module imports Ray, and starts the e2e clusters with the trainer's production
runtime env (``rl_e2e_runtime_env`` in ``pyproject.toml``).
"""

pytest_plugins = ["rl_e2e.plugin"]
