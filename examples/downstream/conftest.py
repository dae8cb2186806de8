"""Root conftest: the one line that turns on the rl_e2e plugin (configured in pyproject.toml)."""

pytest_plugins = ["rl_e2e.plugin"]
