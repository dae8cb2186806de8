"""A real ``ray job submit``: the job's runtime env wins over the trainer's, without conflicts.

The ``e2e_ray_job`` fixture runs ``ray start --head`` with token auth on, and
a small driver is submitted with ``--runtime-env-json`` setting
``NCCL_DEBUG=INFO`` (our default is ``WARN``) and a ``working_dir``. The driver
calls ``ray.init(runtime_env=get_runtime_env())``: without the layering Ray
would refuse the merge; with it the job succeeds and its workers see ``INFO``.
Then ``python -m trainer`` itself runs in the job: it must join the cluster it
was submitted to (Ray gives the job ``RAY_ADDRESS``) and train a step there.
Both run in one submitted job (the ``submitted`` fixture), each test reading its part.
"""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from deadlines import hang_guard

pytestmark = pytest.mark.timeout(hang_guard(300))

REPO = Path(__file__).resolve().parents[2]

#: The smallest ``python -m trainer`` run: one step of 2 prompts x 2 responses.
TINY_RUN = [
    "algo=grpo",
    "trainer.total_steps=1",
    "trainer.val_every=0",
    "trainer.progress=false",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "data.num_train_examples=8",
    "data.num_val_examples=2",
]

DRIVER = """
import json, os, tempfile
import ray
from trainer.launch.runtime_env import get_runtime_env

ray.init(runtime_env=get_runtime_env())

@ray.remote(num_cpus=1)
def look():
    return {
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
        "marker_in_cwd": os.path.exists("marker.txt"),
        "pid": os.getpid(),
        "tempdir": tempfile.gettempdir(),
    }

results = ray.get([look.remote() for _ in range(2)])
print("RESULT " + json.dumps(results), flush=True)
print("DRIVER TEMPDIR " + tempfile.gettempdir(), flush=True)
"""


@pytest.fixture(scope="module")
def submitted(e2e_ray_job, tmp_path_factory):
    """One job for both tests: the driver, then ``python -m trainer``, in one entrypoint.

    Each ``ray job submit`` costs a job supervisor and the CLI calls that submit it,
    poll its status and fetch its logs; the two tests read different parts of one
    job's output. The trainer runs whatever the driver did (``;``), and the driver's
    exit status is printed for its own test; the job's status is the trainer's.
    """
    tmp = tmp_path_factory.mktemp("submitted")
    working_dir = tmp / "job"
    working_dir.mkdir()
    (working_dir / "driver.py").write_text(textwrap.dedent(DRIVER))
    (working_dir / "marker.txt").write_text("shipped with working_dir\n")
    run_dir = tmp / "run"
    trainer = shlex.join([sys.executable, "-m", "trainer", *TINY_RUN, f"trainer.run_dir={run_dir}"])
    script = f'{shlex.quote(sys.executable)} driver.py; echo "DRIVER EXIT $?"; exec {trainer}'
    runtime_env = {
        "env_vars": {
            "NCCL_DEBUG": "INFO",
            "PYTHONPATH": str(REPO),
            "TRAINER_CACHE": str(tmp / "cache"),
        },
        "working_dir": str(working_dir),
    }
    done = e2e_ray_job.submit(["sh", "-c", script], runtime_env, hang_guard(270))
    return done, run_dir


def test_the_jobs_runtime_env_wins_over_the_trainers(e2e_ray_job, submitted):
    done, _ = submitted
    output = done.stdout + done.stderr
    assert "DRIVER EXIT 0\n" in output, output[-5000:]
    (line,) = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    results = json.loads(line.removeprefix("RESULT "))
    assert len(results) == 2
    for seen in results:
        assert seen["NCCL_DEBUG"] == "INFO"  # the job's value, not our WARN
        assert seen["TOKENIZERS_PARALLELISM"] == "true"  # our default still applies
        assert seen["marker_in_cwd"] is True  # the job's working_dir
        assert seen["tempdir"] == str(e2e_ray_job.tmp)  # removed with the cluster
    assert f"DRIVER TEMPDIR {e2e_ray_job.tmp}\n" in output


def test_a_submitted_trainer_joins_the_cluster_it_was_submitted_to(submitted):
    """Ray gives the job RAY_ADDRESS: ``python -m trainer`` trains a step there."""
    trained, run_dir = submitted
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-5000:]
    assert "trainer: done: 1 steps" in trained.stdout
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1
