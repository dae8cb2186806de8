"""minirl's Ray code on the plugin's cluster, with minirl's own runtime env.

The module's host variables are set (only) while the cluster's runtime env is
built, as they would be on the driver's host: what the workers see of them
proves the forwarding and the exclusion of ``pyproject.toml``.
"""

from __future__ import annotations

import os

import pytest
from minirl.launch import runtime_env
from minirl.rollout import fan_out_scores, worker_settings

HOST_ENV = {
    "MINIRL_RUN_NAME": "proof-from-outside",  # forwarded: MINIRL_ prefix
    "HF_HUB_OFFLINE": "1",  # forwarded: HF_ prefix
    "MINIRL_SECRET_KEY": "never-shipped",  # excluded: MINIRL_SECRET*
}


@pytest.fixture(scope="module")
def e2e_ray_host_env() -> dict[str, str]:
    """The driver host's variables, for every cluster of this module."""
    return HOST_ENV


def test_scores_fan_out_and_come_back_in_order(e2e_ray):
    """Two scorer actors split the prompts; the scores return in the prompts' order."""
    assert fan_out_scores(["a", "bb", "ccc", "dddd", "eeeee"], 2) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_workers_see_defaults_and_forwarded_vars_not_secrets(e2e_ray):
    """A worker sees minirl's defaults and the forwarded host variables, never a secret."""
    (seen,) = worker_settings(1)
    assert seen["MINIRL_LOG_LEVEL"] == "INFO"
    assert seen["TOKENIZERS_PARALLELISM"] == "false"
    assert seen["MINIRL_RUN_NAME"] == "proof-from-outside"
    assert seen["HF_HUB_OFFLINE"] == "1"
    assert "MINIRL_SECRET_KEY" not in seen


def test_driver_and_tests_compose_the_same_runtime_env(e2e_ray):
    """The ini options and minirl.launch.LAYERS agree: tests run what production runs."""
    assert runtime_env({**os.environ, **HOST_ENV}) == e2e_ray.runtime_env
