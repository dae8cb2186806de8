"""Where a run's metrics go: metrics.jsonl and the reward curve, experiment trackers, the progress line."""
