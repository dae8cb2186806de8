"""The trainer's runtime env (rl_e2e's layering with its choices) and worker setup hook, without Ray.

The real-Ray checks (what workers see) are in tests/e2e/test_fixtures.py and
tests/e2e/test_ray_job_submit.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from rl_e2e.runtime_env import (
    JOB_CONFIG_VAR,
    compose_runtime_env,
    forwarded_env_vars,
    load_hook,
    parse_exclude,
    parse_hook_spec,
    parse_job_runtime_env,
    run_extra_hook,
)
from rl_e2e.warm_workers import SWITCH_VARIABLE, py_executable
from rl_e2e.worker_shim import PRELOAD_VARIABLE
from trainer.launch import runtime_env as rt
from trainer.launch.runtime_env import (
    DEFAULT_ENV_VARS,
    EXTRA_HOOK_VAR,
    FORWARD_PREFIXES,
    WARM_PRELOAD,
    WORKER_SETUP_HOOK,
    get_runtime_env,
    worker_setup,
)


def _job(runtime_env: dict) -> str:
    return json.dumps({"runtime_env": runtime_env, "metadata": {}})


# --- layer 1: defaults -----------------------------------------------------------


def test_defaults_named_by_the_issue():
    assert DEFAULT_ENV_VARS["TOKENIZERS_PARALLELISM"] == "true"
    assert DEFAULT_ENV_VARS["NCCL_DEBUG"] == "WARN"
    assert DEFAULT_ENV_VARS["VLLM_LOGGING_LEVEL"] == "WARN"
    assert DEFAULT_ENV_VARS["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert DEFAULT_ENV_VARS["NCCL_CUMEM_ENABLE"] == "0"


def test_empty_host_gives_defaults_hook_warm_start_and_no_working_dir():
    env = get_runtime_env({})
    assert env == {
        "env_vars": {**DEFAULT_ENV_VARS, PRELOAD_VARIABLE: ",".join(WARM_PRELOAD)},
        "working_dir": None,
        "worker_process_setup_hook": WORKER_SETUP_HOOK,
        "py_executable": py_executable(),
    }


def test_warm_start_off_gives_only_defaults_hook_and_no_working_dir():
    env = get_runtime_env({SWITCH_VARIABLE: "0"})
    assert env == {
        "env_vars": DEFAULT_ENV_VARS,
        "working_dir": None,
        "worker_process_setup_hook": WORKER_SETUP_HOOK,
    }
    assert env["env_vars"] is not DEFAULT_ENV_VARS  # a copy: callers may edit it


def test_a_job_that_picks_the_workers_interpreter_keeps_it():
    env = get_runtime_env({JOB_CONFIG_VAR: _job({"pip": ["six"]})})
    assert "py_executable" not in env and PRELOAD_VARIABLE not in env["env_vars"]


def test_hook_dotted_path_resolves_to_worker_setup():
    module_name, _, func_name = WORKER_SETUP_HOOK.rpartition(".")
    assert module_name == rt.__name__
    assert getattr(rt, func_name) is worker_setup


# --- layer 2: forwarding by prefix and TRAINER_EXCLUDE ---------------------------


def test_forwarding_by_prefix():
    host = {
        "HF_HOME": "/hf",
        "VLLM_USE_V1": "1",
        "NCCL_DEBUG": "INFO",
        "TRAINER_LOG_LEVEL": "DEBUG",
        "PATH": "/bin",
        "HOME": "/root",
        "MY_HF_HOME": "x",  # prefix must be at the start
    }
    assert forwarded_env_vars(host, prefixes=FORWARD_PREFIXES) == {
        "HF_HOME": "/hf",
        "VLLM_USE_V1": "1",
        "NCCL_DEBUG": "INFO",
        "TRAINER_LOG_LEVEL": "DEBUG",
    }


def test_every_listed_prefix_forwards():
    host = {f"{prefix}X": prefix for prefix in FORWARD_PREFIXES}
    assert forwarded_env_vars(host, prefixes=FORWARD_PREFIXES) == host


def test_host_value_beats_default():
    env = get_runtime_env({"NCCL_DEBUG": "TRACE"})
    assert env["env_vars"]["NCCL_DEBUG"] == "TRACE"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ()),
        ("HF_HOME", ("HF_HOME",)),
        (" VLLM* ,  HF_HOME , ", ("VLLM*", "HF_HOME")),
        (",,", ()),
    ],
)
def test_parse_exclude(spec, expected):
    assert parse_exclude(spec) == expected


def test_exclude_exact_names_and_globs():
    host = {
        "HF_HOME": "/hf",
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V1": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "NCCL_DEBUG": "INFO",
        "TRAINER_EXCLUDE": " VLLM* , HF_HOME ",
    }
    env = get_runtime_env(host)["env_vars"]
    assert "HF_HOME" not in env
    assert env["HF_HUB_OFFLINE"] == "1"  # exact name only drops HF_HOME
    assert "VLLM_USE_V1" not in env
    # An excluded host value does not remove the default: the default stays.
    assert env["VLLM_LOGGING_LEVEL"] == DEFAULT_ENV_VARS["VLLM_LOGGING_LEVEL"]
    assert env["NCCL_DEBUG"] == "INFO"
    assert "TRAINER_EXCLUDE" not in env


def test_exclude_is_case_sensitive_and_anchored():
    host = {"HF_HOME": "/hf", "TRAINER_EXCLUDE": "hf_home,HOME"}
    assert get_runtime_env(host)["env_vars"]["HF_HOME"] == "/hf"


def test_trainer_exclude_never_forwarded_even_when_empty():
    assert "TRAINER_EXCLUDE" not in get_runtime_env({"TRAINER_EXCLUDE": ""})["env_vars"]


# --- layer 3: the `ray job submit` runtime env ----------------------------------


def test_job_env_vars_are_left_to_the_job():
    host = {
        "HF_HOME": "/host-hf",
        JOB_CONFIG_VAR: _job({"env_vars": {"NCCL_DEBUG": "INFO", "HF_HOME": "/job-hf"}}),
    }
    env = get_runtime_env(host)
    assert "NCCL_DEBUG" not in env["env_vars"]
    assert "HF_HOME" not in env["env_vars"]
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == "true"
    assert env["working_dir"] is None
    assert env["worker_process_setup_hook"] == WORKER_SETUP_HOOK


def test_job_working_dir_and_hook_are_not_contested():
    job = {"working_dir": "gcs://_ray_pkg_abc.zip", "worker_process_setup_hook": "x.y"}
    env = get_runtime_env({JOB_CONFIG_VAR: _job(job)})
    assert "working_dir" not in env
    assert "worker_process_setup_hook" not in env


def test_no_key_of_ours_conflicts_with_the_job():
    """Ray's merge refuses any shared key (without RAY_OVERRIDE_JOB_RUNTIME_ENV)."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    job = {
        "working_dir": "gcs://_ray_pkg_abc.zip",
        "env_vars": {"NCCL_DEBUG": "INFO", "TRAINER_X": "job"},
    }
    ours = get_runtime_env({"TRAINER_X": "host", JOB_CONFIG_VAR: _job(job)})
    merged = _merge_runtime_env(job, ours, override=False)
    assert merged is not None
    assert merged["env_vars"]["NCCL_DEBUG"] == "INFO"
    assert merged["env_vars"]["TRAINER_X"] == "job"
    assert merged["working_dir"] == job["working_dir"]


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"runtime_env": "oops"}),
        json.dumps({"runtime_env": {"env_vars": ["A=1"]}}),
    ],
)
def test_malformed_job_config_is_a_warning_and_two_layers(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="rl_e2e.runtime_env"):
        env = get_runtime_env({"HF_HOME": "/hf", JOB_CONFIG_VAR: raw})
    assert env == get_runtime_env({"HF_HOME": "/hf"})
    assert any(JOB_CONFIG_VAR in r.getMessage() for r in caplog.records)


def test_parse_job_runtime_env_names_the_variable():
    with pytest.raises(ValueError, match=JOB_CONFIG_VAR):
        parse_job_runtime_env("{")
    assert parse_job_runtime_env(None) is None
    assert parse_job_runtime_env(" ") is None
    assert parse_job_runtime_env(json.dumps({"metadata": {}})) == {}


def test_compose_is_pure():
    defaults = {"A": "1"}
    forwarded = {"B": "2"}
    job = {"env_vars": {"A": "9"}}
    out = compose_runtime_env(defaults, forwarded, job)
    assert out["env_vars"] == {"B": "2"}
    assert defaults == {"A": "1"} and forwarded == {"B": "2"} and job == {"env_vars": {"A": "9"}}


# --- logging: secrets never shown -------------------------------------------------


def test_secret_values_never_logged(caplog):
    host = {"HF_TOKEN": "hf_supersecretvalue", "HF_HOME": "/visible-hf-home"}
    with caplog.at_level(logging.DEBUG, logger="rl_e2e.runtime_env"):
        env = get_runtime_env(host)
    assert env["env_vars"]["HF_TOKEN"] == "hf_supersecretvalue"  # still forwarded
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "HF_TOKEN=<redacted>" in text
    assert "/visible-hf-home" in text
    assert "supersecretvalue" not in text


# --- the extra worker setup hook ---------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_trainer_logger():
    """worker_setup configures the "trainer" logger; keep that out of other tests."""
    logger = logging.getLogger("trainer")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]


@pytest.fixture
def hook_file(tmp_path):
    path = tmp_path / "not_on_sys_path" / "my_hook.py"
    path.parent.mkdir()
    path.write_text(
        textwrap.dedent(
            """
            import os
            from pathlib import Path

            def ok():
                Path(os.environ["HOOK_OUT"]).write_text(str(os.getpid()))

            def boom():
                raise RuntimeError("boom from hook")

            def leave():
                raise SystemExit(3)

            NOT_CALLABLE = 1
            """
        )
    )
    return path


def test_hook_loaded_from_file_not_on_sys_path(hook_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("HOOK_OUT", str(out))
    assert run_extra_hook(f"{hook_file}:ok", EXTRA_HOOK_VAR) is True
    assert out.read_text() == str(os.getpid())


def test_worker_setup_runs_the_extra_hook(hook_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("HOOK_OUT", str(out))
    monkeypatch.setenv(EXTRA_HOOK_VAR, f"{hook_file}:ok")
    worker_setup()
    assert out.exists()


@pytest.mark.parametrize("func", ["boom", "leave"])
def test_failing_hook_is_logged_with_traceback_and_never_raises(hook_file, func, caplog):
    with caplog.at_level(logging.ERROR, logger="rl_e2e.runtime_env"):
        assert run_extra_hook(f"{hook_file}:{func}", EXTRA_HOOK_VAR) is False
    (record,) = [r for r in caplog.records if EXTRA_HOOK_VAR in r.getMessage()]
    assert record.exc_info is not None
    assert "continues" in record.getMessage()


def test_worker_setup_survives_bad_spec_and_bad_log_level(monkeypatch, caplog):
    monkeypatch.setenv(EXTRA_HOOK_VAR, "relative/file.py:fn")
    monkeypatch.setenv("TRAINER_LOG_LEVEL", "LOUD")
    with caplog.at_level(logging.ERROR, logger="rl_e2e.runtime_env"):
        worker_setup()  # must not raise
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "TRAINER_LOG_LEVEL" in " ".join(str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert EXTRA_HOOK_VAR in text


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("/abs/file.py", "must look like"),
        ("relative.py:fn", "not an absolute path"),
        ("/does/not/exist.py:fn", "no file"),
        (":fn", "must look like"),
        ("/abs/file.py:not-a-name", "must look like"),
    ],
)
def test_bad_hook_spec_names_the_variable(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_hook_spec(spec, EXTRA_HOOK_VAR)
    assert EXTRA_HOOK_VAR in str(info.value)


def test_missing_or_non_callable_function(hook_file):
    with pytest.raises(ValueError, match="no function 'absent'"):
        load_hook(f"{hook_file}:absent", EXTRA_HOOK_VAR)
    with pytest.raises(ValueError, match="no function 'NOT_CALLABLE'"):
        load_hook(f"{hook_file}:NOT_CALLABLE", EXTRA_HOOK_VAR)


def test_non_python_file_is_refused(tmp_path):
    path = tmp_path / "hook.txt"
    path.write_text("def f(): pass\n")
    with pytest.raises(ValueError, match="not a Python file"):
        load_hook(f"{path}:f", EXTRA_HOOK_VAR)


def test_worker_setup_sets_the_trainer_log_level(monkeypatch):
    monkeypatch.delenv(EXTRA_HOOK_VAR, raising=False)
    monkeypatch.setenv("TRAINER_LOG_LEVEL", "debug")
    worker_setup()
    assert logging.getLogger("trainer").level == logging.DEBUG


# --- the warm preload ---------------------------------------------------------------

# What a worker does up to its first step, after the warm process's imports.
WORKER_IMPORTS = """\
import importlib, sys
for name in sys.argv[2].split(","):
    importlib.import_module(name)
before = set(sys.modules)
import trainer.controller.host, trainer.workers.actor, trainer.workers.critic
import trainer.workers.rollout, trainer.rollout.hf
import torch
from trainer.models import load_causal_lm, load_tokenizer
load_tokenizer(sys.argv[1])
load_causal_lm(sys.argv[1]).generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=True)
print("\\n".join(sorted(set(sys.modules) - before)))
"""
# Third-party code that costs a worker seconds to import, for each worker again.
HEAVY = ("transformers.models.", "transformers.generation", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "tokenizers", "omegaconf")  # fmt: skip


def test_the_warm_preload_leaves_a_worker_no_heavy_import_of_its_own(tmp_path):
    """``transformers`` is a lazy module: preloading it alone left each worker its models."""
    from trainer.models import ensure_tiny_model

    model = ensure_tiny_model(cache_dir=tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_IMPORTS, str(model), ",".join(WARM_PRELOAD)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    own = [name for name in proc.stdout.split() if name.startswith(HEAVY)]
    assert not own, f"imported by each worker, not by the warm process: {own}"
