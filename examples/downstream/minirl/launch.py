"""The driver: compose the runtime env, start Ray, score prompts on N actors.

``LAYERS`` is this repository's runtime env; the tests' clusters get the same
one from the ``rl_e2e_env_*`` options in ``pyproject.toml``
(``tests/test_rollout.py`` checks the two agree). Run it as
``python -m minirl.launch`` or submit it with ``ray job submit``: a job's own
``--runtime-env-json`` variables win over ours.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from rl_e2e.runtime_env import RuntimeEnvLayers

LAYERS = RuntimeEnvLayers(
    defaults={"MINIRL_LOG_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"},
    forward_prefixes=("MINIRL_", "HF_"),
    exclude=("MINIRL_SECRET*",),
)


def runtime_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The runtime env the driver passes to ``ray.init`` (``environ``: default ``os.environ``)."""
    return LAYERS.compose(environ)


def main(argv: list[str] | None = None) -> None:
    """Score a few prompts on ``--actors`` scorers; print ``RESULT <json>``."""
    parser = argparse.ArgumentParser(prog="python -m minirl.launch")
    parser.add_argument("--actors", type=int, default=2, help="scorer actors to fan out to")
    args = parser.parse_args(argv)

    import ray

    from minirl.rollout import fan_out_scores, worker_settings

    ray.init(runtime_env=runtime_env())  # joins RAY_ADDRESS when submitted as a job
    prompts = ["a", "bb", "ccc", "dddd"]
    result = {
        "scores": fan_out_scores(prompts, args.actors),
        "workers": worker_settings(args.actors),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
