"""The RL loop on the driver: the single-controller PPO/GRPO trainer and its plain single-process reference."""
