"""Asynchronous RL: a rollout pool, bounded staleness, versioned batches, checked weight pushes.

The bookkeeping of the bound is tested pure; the rest on real Ray worker
groups (one actor rank, one rollout rank, the tiny model): ``k = 0`` on the
pool is the colocated synchronous trainer update for update, ``k = 1`` keeps
every lag within the bound whichever side is slower, and faulty weight pushes
show in the metrics.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from deadlines import hang_guard
from ray import cloudpickle
from ray_trainers import trainer_on_ray
from trainer_processes import assert_all_gone, tagged, trainer_process, wait_for_first_step

from trainer.config import ConfigError, load_config
from trainer.controller import WorkerDiedError, WorkerError
from trainer.loop.staleness import Admission, StalenessError, check_lag
from trainer.models import ensure_tiny_model
from trainer.workers.rollout import RolloutWorker, weights_fingerprint
from trainer.workers.settings import policy_settings

# The faulty and slow workers below travel to the Ray workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TINY = [
    "algo=grpo",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",  # two mini-batches: the old-log-prob pass runs
    "rollout.n=2",
    "data.num_val_examples=4",
    "data.num_train_examples=32",
    "trainer.val_every=0",
    "trainer.num_workers=1",
    "actor.micro_batch_size=4",
]

# ----------------------------------------------------------------------------- pure


def test_check_lag_accepts_the_bound_and_refuses_beyond_it_or_the_future():
    assert check_lag(5, 5, 0) == 0
    assert check_lag(5, 4, 1) == 1
    with pytest.raises(StalenessError, match=r"lag 2 exceeds rollout.staleness=1"):
        check_lag(5, 3, 1)
    with pytest.raises(StalenessError, match="has not reached"):
        check_lag(5, 6, 1)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_admission_never_draws_more_than_k_ahead_and_drains_at_the_end(k):
    total = 7
    adm = Admission(k, total)
    for step in range(total):
        while adm.may_draw(step):
            adm.draw(step)
        assert adm.ahead(step) == min(k, total - step - 1)
    assert [i for i, _ in adm.drawn] == list(range(total))  # every batch once, in order
    assert all(index - step <= k for index, step in adm.drawn)
    assert not adm.may_draw(total)  # the end of the data: nothing more is drawn
    with pytest.raises(StalenessError, match="may not be drawn"):
        adm.draw(0)


def test_k0_draws_a_step_batch_only_when_that_step_begins():
    adm = Admission(0, 3)
    assert adm.may_draw(0) and adm.draw(0) == 0
    assert not adm.may_draw(0)
    assert adm.draw(1) == 1


def test_a_restart_draws_from_the_resumed_step():
    adm = Admission(2, 10)
    for _ in range(3):
        adm.draw(0)
    adm.restart(1)
    assert adm.draw(1) == 1


def test_the_fingerprint_tells_apart_weights_that_differ_anywhere():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    b = {k: v.clone() for k, v in a.items()}
    assert weights_fingerprint(a) == weights_fingerprint(b)
    b["w"][1, 2] += 1e-3
    assert weights_fingerprint(a) != weights_fingerprint(b)
    swapped = {"w": a["w"].flip(1), "b": a["b"]}  # same sum, other positions
    assert weights_fingerprint(a) != weights_fingerprint(swapped)


def test_a_fresh_local_cluster_has_room_for_the_rollout_pool():
    """``python -m trainer rollout.staleness=1`` on defaults: one CPU more for the rollout worker."""
    from trainer.placement import local_cpus

    for device in ("auto", "cpu"):
        plain = load_config([f"trainer.device={device}"])
        pooled = load_config([f"trainer.device={device}", "rollout.staleness=1"])
        assert local_cpus(pooled) == local_cpus(plain) + 1
    assert local_cpus(load_config(["trainer.num_workers=2", "rollout.workers=3"])) == 5


def test_the_importance_cap_defaults_on_with_staleness_and_off_without():
    assert load_config([]).importance_cap == 0.0
    assert load_config(["rollout.workers=1"]).importance_cap == 0.0
    assert load_config(["rollout.staleness=1"]).importance_cap == 2.0
    assert load_config(["rollout.staleness=1", "rollout.tis_cap=0"]).importance_cap == 0.0
    assert load_config(["rollout.staleness=2", "rollout.tis_cap=3"]).importance_cap == 3.0


def test_the_importance_weight_is_the_response_s_with_staleness_and_the_token_s_without():
    """bench/async_learning.py: with token weights k=1 needed 41.8 steps to 0.9 against 34.1."""
    assert load_config([]).importance_level == "token"
    assert load_config(["rollout.workers=1"]).importance_level == "token"
    assert load_config(["rollout.engine=vllm", "rollout.tis_cap=2"]).importance_level == "token"
    assert load_config(["rollout.staleness=1"]).importance_level == "sequence"
    k1_token = load_config(["rollout.staleness=1", "rollout.tis_level=token"])
    assert k1_token.importance_level == "token"
    assert policy_settings(load_config(["rollout.staleness=1"]), 0).tis_level == "sequence"
    with pytest.raises(ConfigError, match="rollout.tis_level='geometric'"):
        load_config(["rollout.tis_level=geometric"])


# ----------------------------------------------------------------------------- on Ray


class SlowRolloutWorker(RolloutWorker):
    """Generation slower than training."""

    def generate_sequences(self, prompts, validation=False):
        time.sleep(0.6)
        return super().generate_sequences(prompts, validation)


class NoOpPushWorker(RolloutWorker):
    """A push that does nothing: the engine keeps its first weights."""

    def _load(self, state):
        if getattr(self, "_loaded_once", False):
            return
        self._loaded_once = True
        super()._load(state)


class StalePushWorker(RolloutWorker):
    """A push that lands the previous version's weights."""

    def _load(self, state):
        previous = getattr(self, "_previous", None)
        self._previous = {k: v.clone() for k, v in state.items()}
        super()._load(previous if previous is not None else state)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _trainer(model_dir, overrides, rollout_cls=None):
    return trainer_on_ray(model_dir, [*TINY, *overrides], rollout_cls)


def _fit(model_dir, overrides, rollout_cls=None, on_step=None):
    with _trainer(model_dir, overrides, rollout_cls) as (trainer, groups):
        history = trainer.fit(on_step)
        weights = groups["actor"].full_state_dict()[0]
    return trainer, history, weights


def test_k0_on_a_rollout_pool_is_the_colocated_synchronous_trainer_update_for_update(
    e2e_ray, model_dir
):
    steps = ["trainer.total_steps=4"]
    _, colocated, w_colocated = _fit(model_dir, steps)
    pooled_trainer, pooled, w_pooled = _fit(model_dir, [*steps, "rollout.workers=1"])
    assert pooled_trainer.rollouts.lags == [0, 0, 0, 0]
    for step, (a, b) in enumerate(zip(colocated, pooled, strict=True), 1):
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout/reward_mean"):
            assert a[key] == b[key], f"step {step}: {key} {a[key]} != {b[key]}"
        # The pool's engine sampled from the weights the actor held: lag 0, a float-rounding gap.
        assert b["async/lag_max"] == 0 and b["rollout/actor_logprob_diff_mean/lag0"] < 1e-6
    assert all(b.get("async/weights_in_sync", 1.0) == 1.0 for b in pooled)
    for name, tensor in w_colocated.items():
        assert torch.equal(tensor, w_pooled[name]), name


@pytest.mark.parametrize("slow", ["generation", "training"])
def test_k1_keeps_every_lag_within_one_whichever_side_is_slower(e2e_ray, model_dir, slow):
    def train_slowly(step, metrics):
        time.sleep(0.6)  # the driver busy after each update, as a longer update would be

    trainer, history, _ = _fit(
        model_dir,
        ["trainer.total_steps=5", "rollout.staleness=1"],
        rollout_cls=SlowRolloutWorker if slow == "generation" else None,
        on_step=train_slowly if slow == "training" else None,
    )
    assert trainer.rollouts.lags == [0, 1, 1, 1, 1]
    assert all(index - step <= 1 for index, step in trainer.rollouts.admission.drawn)
    assert [m["async/queue_depth"] for m in history] == [1, 1, 1, 1, 0]
    assert all(m["async/lag_max"] <= 1 for m in history)
    # Which side waited is a matter of timing (reported, not asserted): the bound is not.
    for m in history:
        assert 0.0 <= m["async/trainer_idle_frac"] <= 1.0
        assert 0.0 <= m["async/rollout_idle_frac"] <= 1.0


@pytest.mark.parametrize("worker", [NoOpPushWorker, StalePushWorker], ids=["no-op", "stale"])
def test_a_push_that_misses_shows_in_the_metrics(e2e_ray, model_dir, worker):
    _, history, _ = _fit(
        model_dir, ["trainer.total_steps=3", "rollout.workers=1"], rollout_cls=worker
    )
    # Version 0 is the model both sides loaded; every later push misses.
    assert history[0]["async/weights_in_sync"] == 1.0
    assert [m["async/weights_in_sync"] for m in history[1:]] == [0.0, 0.0]
    # The engine sampled from weights the actor no longer holds, at lag 0: a real gap.
    gaps = [m["rollout/actor_logprob_diff_mean/lag0"] for m in history]
    assert gaps[0] < 1e-6 and min(gaps[1:]) > 1e-3, gaps


class FailingRolloutWorker(RolloutWorker):
    """The engine raises on its second batch."""

    def generate_sequences(self, prompts, validation=False):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 2:
            raise RuntimeError("the engine ran out of KV cache")
        return super().generate_sequences(prompts, validation)


class DyingRolloutWorker(RolloutWorker):
    """The process dies on its second batch."""

    def generate_sequences(self, prompts, validation=False):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 2:
            os._exit(3)
        return super().generate_sequences(prompts, validation)


@pytest.mark.parametrize(
    ("worker", "error", "says"),
    [
        (FailingRolloutWorker, WorkerError, "the engine ran out of KV cache"),
        (DyingRolloutWorker, WorkerDiedError, "died"),
    ],
    ids=["raises", "dies"],
)
def test_a_rollout_worker_that_fails_ends_the_run_naming_it(
    e2e_ray, model_dir, worker, error, says
):
    with pytest.raises(error) as info:
        _fit(model_dir, ["trainer.total_steps=4", "rollout.staleness=1"], rollout_cls=worker)
    text = str(info.value)
    assert "rollout" in text and "rank 0" in text and says in text, text


def test_a_resume_at_k1_restores_the_version_and_draws_the_queued_batches_again(e2e_ray, model_dir):
    saved = {}
    k1 = ["rollout.staleness=1"]

    def save_at_2(step, metrics):
        if step == 2:
            saved.update(trainer.state_dict())
            saved["live_position"] = trainer.loader.state_dict()["position"]

    with _trainer(model_dir, [*k1, "trainer.total_steps=3"]) as (trainer, _):
        trainer.fit(save_at_2)
    batch = 4  # data.train_batch_size
    # Batch 2 was drawn (and generated) before the save: the checkpoint keeps the
    # data position before it, so a resume draws those prompts again.
    assert saved["step"] == 2 and saved["loader"]["position"] == 2 * batch
    assert saved["live_position"] == 3 * batch
    with _trainer(model_dir, [*k1, "trainer.total_steps=4"]) as (resumed, _):
        resumed.load_state_dict({k: v for k, v in saved.items() if k != "live_position"})
        history = resumed.fit()
    assert [index for index, _ in resumed.rollouts.admission.drawn] == [2, 3]
    # The first batch after the resume comes from the resumed weights, pushed as version 2.
    assert resumed.rollouts.lags == [0, 1]
    assert history[0]["async/push_version"] == 2.0


def test_ctrl_c_during_an_async_run_leaves_no_process(tmp_path):
    """SIGINT to ``python -m trainer rollout.staleness=1`` while a batch is queued ahead."""
    run_dir = tmp_path / "run"
    overrides = [*TINY, "rollout.staleness=1", "trainer.total_steps=500", "trainer.progress=false"]
    seen = []
    with trainer_process(tmp_path, *overrides, f"trainer.run_dir={run_dir}") as (driver, tag):
        wait_for_first_step(driver, run_dir)
        seen = tagged(tag)
        hosts = [p for p in seen if "WorkerHost" in " ".join(p.cmdline())]
        assert len(hosts) == 2, [p.cmdline() for p in seen]  # one actor, one rollout worker
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=hang_guard(120))
        assert driver.returncode != 0, out
    assert_all_gone(tag, seen)
