"""Reporting: what a run shows while it runs and writes when it ends."""
