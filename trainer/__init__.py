"""A reference single-controller PPO trainer on Ray."""

from gpusched import DISTRIBUTION, __version__  # one distribution, one version

__all__ = ["DISTRIBUTION", "__version__"]
