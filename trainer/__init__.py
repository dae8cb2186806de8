"""A reference single-controller PPO trainer on Ray."""
