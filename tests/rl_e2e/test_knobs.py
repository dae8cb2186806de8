"""Typed environment knobs: read at call time, empty means default, malformed names the variable."""

from __future__ import annotations

import math

import pytest

from rl_e2e.knobs import env_bool, env_float, env_int, env_str, looks_secret, redact

VAR = "TRAINER_TEST_KNOB"


@pytest.mark.parametrize(
    ("reader", "default"),
    [(env_int, 7), (env_float, 0.5), (env_str, "dflt"), (env_bool, True)],
)
@pytest.mark.parametrize("raw", [None, "", "   "])
def test_unset_or_empty_gives_the_default(monkeypatch, reader, default, raw):
    if raw is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, raw)
    assert reader(VAR, default) == default


@pytest.mark.parametrize(
    ("reader", "raw", "expected"),
    [
        (env_int, "42", 42),
        (env_int, " -3 ", -3),
        (env_float, "2.5", 2.5),
        (env_float, "1e-3", 1e-3),
        (env_str, " lo ", "lo"),
        (env_bool, "1", True),
        (env_bool, "TRUE", True),
        (env_bool, "on", True),
        (env_bool, "no", False),
        (env_bool, "0", False),
    ],
)
def test_values_parse(monkeypatch, reader, raw, expected):
    monkeypatch.setenv(VAR, raw)
    default = {env_int: 0, env_float: 0.0, env_str: "", env_bool: not expected}[reader]
    assert reader(VAR, default) == expected


def test_read_at_call_time_not_import_time(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    assert env_int(VAR, 0) == 1
    monkeypatch.setenv(VAR, "2")
    assert env_int(VAR, 0) == 2


def test_inf_is_a_float(monkeypatch):
    monkeypatch.setenv(VAR, "inf")
    assert math.isinf(env_float(VAR, 0.0))


@pytest.mark.parametrize(
    ("reader", "raw"),
    [
        (env_int, "4.0"),
        (env_int, "four"),
        (env_float, "fast"),
        (env_float, "nan"),
        (env_bool, "maybe"),
        (env_bool, "2"),
    ],
)
def test_malformed_names_variable_and_value(monkeypatch, reader, raw):
    monkeypatch.setenv(VAR, raw)
    with pytest.raises(ValueError) as info:
        reader(VAR, None)
    assert VAR in str(info.value)
    assert repr(raw) in str(info.value)


def test_explicit_mapping_instead_of_os_environ(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    assert env_int(VAR, 0, environ={VAR: "5"}) == 5
    assert env_int(VAR, 9, environ={}) == 9


@pytest.mark.parametrize(
    "name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "hf_token"]
)
def test_secret_names_are_redacted(name):
    assert looks_secret(name)
    assert redact(name, "hunter2") == "<redacted>"


@pytest.mark.parametrize(
    "name", ["HF_HOME", "NCCL_DEBUG", "TRAINER_EXCLUDE", "TOKENIZERS_PARALLELISM", "KEYBOARD"]
)
def test_ordinary_names_are_shown(name):
    assert not looks_secret(name)
    assert redact(name, "value") == "value"
