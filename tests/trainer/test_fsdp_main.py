"""Acceptance: ``python -m trainer`` with FSDP2 actor and critic on CPU (gloo), as a user runs it.

The real workers shard the policy and the critic with
``fully_shard`` over two Ray worker processes; the run must finish, log finite
losses and the usual metrics, and learn a little (reward up, entropy down)
within a few steps of the seeded ``repeat`` task.
"""

from __future__ import annotations

import json
import math

STEPS = 9


def test_fsdp2_actor_and_critic_train_through_python_m_trainer(trainer_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = trainer_cli(
        "algo=gae",
        "actor.strategy=fsdp2",
        "critic.strategy=fsdp2",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={STEPS}",
        "trainer.val_every=0",
        "trainer.tensorboard=false",
        "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=16",
        "critic.ppo_mini_batch_size=16",
        "rollout.n=4",
        "data.num_train_examples=512",
        # Pinned, so tuning the defaults cannot change what this test measures.
        "actor.ppo_epochs=2",
        "critic.ppo_epochs=1",
        "critic.warmup_steps=0",
        "actor.entropy_coeff=0.0",
        "algorithm.lam=1.0",
        "actor.optim.lr=3e-3",
        "critic.optim.lr=3e-3",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trainer: done: {STEPS} steps" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        for key in ("actor/approx_kl", "actor/pg_clipfrac", "critic/explained_variance"):
            assert key in r, key
    first = sum(r["rollout/reward_mean"] for r in rows[:3]) / 3
    last = sum(r["rollout/reward_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.005, [r["rollout/reward_mean"] for r in rows]
    assert rows[-1]["actor/entropy"] < rows[0]["actor/entropy"] - 0.1
