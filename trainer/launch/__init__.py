"""How the trainer starts on Ray: its production runtime env and the worker setup hook.

Imports neither Ray nor torch, so the e2e plugin can build the runtime env at
the start of a pytest session (``rl_e2e_runtime_env`` in ``pyproject.toml``).
"""
