"""Execution: real processes on real (or simulated) cards, started, watched and killed.

The runner applies the decisions of ``gpusched.scheduling``; nothing here chooses
which file runs next.
"""
