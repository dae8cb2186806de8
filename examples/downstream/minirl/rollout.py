"""Rollout scoring on Ray: a scorer actor, and a fan-out over N of them."""

from __future__ import annotations

import os

import ray

# What a scorer reports of its environment: the variables minirl's runtime env sets.
SETTINGS_PREFIXES = ("MINIRL_", "HF_", "TOKENIZERS_")


@ray.remote(num_cpus=1)
class Scorer:
    """Scores completions; the reward is a stand-in (the length of the text)."""

    def score(self, texts: list[str]) -> list[float]:
        if os.environ.get("MINIRL_LOG_LEVEL") == "DEBUG":
            print(f"scorer {os.getpid()}: scoring {len(texts)} texts", flush=True)
        return [float(len(text)) for text in texts]

    def settings(self) -> dict[str, str]:
        """The minirl-relevant variables this worker process sees."""
        return {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_PREFIXES)}


def fan_out_scores(texts: list[str], n_actors: int) -> list[float]:
    """Score ``texts`` split round-robin over ``n_actors`` scorers; scores in input order."""
    scorers = [Scorer.remote() for _ in range(n_actors)]
    shards = [texts[i::n_actors] for i in range(n_actors)]
    scored = ray.get([s.score.remote(shard) for s, shard in zip(scorers, shards, strict=True)])
    scores = [0.0] * len(texts)
    for i, shard_scores in enumerate(scored):
        scores[i::n_actors] = shard_scores
    for scorer in scorers:
        ray.kill(scorer)
    return scores


def worker_settings(n_actors: int = 1) -> list[dict[str, str]]:
    """What ``n_actors`` fresh scorer workers see of minirl's variables."""
    scorers = [Scorer.remote() for _ in range(n_actors)]
    seen = ray.get([s.settings.remote() for s in scorers])
    for scorer in scorers:
        ray.kill(scorer)
    return seen
