"""minirl: a tiny RL repository (rollout scorers on Ray, gradients averaged over torch.distributed)."""
