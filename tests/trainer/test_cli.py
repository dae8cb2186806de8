"""``python -m trainer``'s command line: help generated from Config, typo'd keys, progress lines.

None of these start Ray: help and key errors come before anything starts, and
the progress is fed metrics by hand on a fake clock.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deadlines import hang_guard

from trainer.cli_help import config_keys, field_docs, format_value, suggest
from trainer.config import Config, ConfigError, load_config
from trainer.logging.progress import Progress, format_duration, plain_line

REPO = Path(__file__).resolve().parents[2]


def _trainer(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(30),
    )


@dataclass
class _Inner:
    depth: int = 3
    """How deep.
    Second line."""


@dataclass
class _Outer:
    name: str = ""
    """The name."""
    plain: bool = True
    inner: _Inner = field(default_factory=_Inner)
    """A nested section."""
    sizes: tuple[float, float] = (0.9, 0.99)


def test_field_docs_are_the_literals_after_each_field():
    assert field_docs(_Outer) == {"name": "The name.", "inner": "A nested section."}
    assert field_docs(_Inner) == {"depth": "How deep.\nSecond line."}


def test_keys_are_dotted_with_type_default_and_help_own_keys_before_sections():
    keys = config_keys(_Outer())
    assert [(k.name, k.section, k.type, k.default) for k in keys] == [
        ("name", "", "str", ""),
        ("plain", "", "bool", True),
        ("sizes", "", "tuple[float, float]", (0.9, 0.99)),
        ("inner.depth", "inner", "int", 3),
    ]
    assert keys[0].help == "The name." and keys[1].help == ""
    assert [format_value(k.default) for k in keys] == ["''", "true", "[0.9,0.99]", "3"]


def test_help_lists_every_key_with_type_and_default_by_section_after_the_examples():
    result = _trainer("--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: python -m trainer [key=value ...]")
    assert out.index("Examples:") < out.index("\ndata:\n") < out.index("\ntrainer:\n")
    assert "  python -m trainer algo=grpo " in out
    lines = out.splitlines()
    for key in config_keys(Config()):
        assert f"  {key.name}: {key.type} = {format_value(key.default)}" in lines, key.name
        if key.help:  # wrapped under the key, words intact
            assert " ".join(key.help.split()) in " ".join(out.split()), key.name
    for section in ("top level", "data", "rollout.multi_turn", "actor", "actor.optim", "trainer"):
        assert f"{section}:" in lines


def test_a_mistyped_key_names_the_nearest_and_exits_2_before_anything_starts():
    result = _trainer("trainer.totl_steps=5")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "trainer: error: unknown key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?\n"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.totl_steps=5", "unknown key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?"),
        ("total_steps=5", "unknown key 'total_steps'; did you mean 'trainer.total_steps'?"),
        ("actor.lr=0.1", "unknown key 'actor.lr'; did you mean 'actor.optim.lr' or 'critic.optim.lr'?"),
        ("zzz=1", "unknown key 'zzz'; python -m trainer --help lists every key"),
        ("trainer.total_steps=many", "trainer.total_steps: Value 'many' of type 'str' could not be converted to Integer"),
        ("trainer.async_save=always", "trainer.async_save='always': choose 'auto', 'true' or 'false'"),
    ],
)  # fmt: skip
def test_key_and_value_errors_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config([override])
    assert str(error.value) == message


def test_keys_given_in_base_are_checked_too():
    with pytest.raises(ConfigError, match=r"did you mean 'data.train_batch_size'\?"):
        load_config([], base={"data": {"train_batchsize": 4}})


def test_suggestions_prefer_the_same_last_part_then_the_closest():
    names = ["trainer.total_steps", "actor.optim.lr", "critic.optim.lr", "seed"]
    assert suggest("actor.lr", names) == ["actor.optim.lr", "critic.optim.lr"]
    assert suggest("trainer.totl_steps", names) == ["trainer.total_steps"]
    assert suggest("nothing_like_it", names) == []


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_line_shows_step_of_total_reward_rate_and_eta():
    assert plain_line(5, 70, 0.4123, 3.2) == "step 5/70: reward 0.412, 3.20 s/step, ETA 3m28s"
    assert (
        plain_line(10, 70, 0.5, 0.5, val=0.875)
        == "step 10/70: reward 0.500, val 0.875, 0.50 s/step, ETA 30s"
    )
    assert plain_line(70, 70, 1.0, 2.0) == "step 70/70: reward 1.000, 2.00 s/step, ETA 0s"
    assert [format_duration(s) for s in (0, 42.4, 208, 3900)] == ["0s", "42s", "3m28s", "1h05m"]


def test_plain_lines_every_slow_step_and_every_ten_seconds_of_fast_ones():
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(True, total=40, start=0, stream=stream, clock=clock)
    assert progress.bar is None
    for step in range(1, 41):
        clock.now += 12.0 if step <= 3 else 1.0  # three slow steps, then fast ones
        m = {"rollout/reward_mean": step / 40}
        if step == 20:
            m["val/reward_mean"] = 0.5
        progress.update(step, m)
    progress.close()
    lines = stream.getvalue().splitlines()
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    # slow: each step; fast: 10 s apart, and the validation step and the last step
    assert steps == [1, 2, 3, 13, 20, 30, 40]
    assert lines[0] == "step 1/40: reward 0.025, 12.00 s/step, ETA 7m48s"
    assert lines[4] == "step 20/40: reward 0.500, val 0.500, 2.65 s/step, ETA 53s"
    assert "\x1b" not in stream.getvalue()


def test_a_resumed_run_counts_its_rate_from_its_own_first_step():
    stream, clock = _Stream(tty=False), _Clock()
    progress = Progress(False, total=20, start=10, stream=stream, clock=clock)
    clock.now += 4.0
    progress.update(11, {"rollout/reward_mean": 1.0})
    assert stream.getvalue() == "step 11/20: reward 1.000, 4.00 s/step, ETA 36s\n"


@pytest.mark.parametrize(
    ("enabled", "tty", "env", "bar"),
    [
        (True, True, {}, True),
        (True, True, {"CI": "true"}, False),
        (True, True, {"TERM": "dumb"}, False),
        (True, False, {}, False),
        (False, True, {}, False),  # trainer.progress=false: plain lines
    ],
)
def test_a_bar_only_on_a_terminal_outside_ci(enabled, tty, env, bar):
    stream = _Stream(tty)
    progress = Progress(enabled, total=3, start=0, stream=stream, environ=env, clock=_Clock())
    try:
        assert (progress.bar is not None) is bar
        progress.update(1, {"rollout/reward_mean": 0.25})
    finally:
        progress.close()
    if not bar:
        assert stream.getvalue().startswith("step 1/3: reward 0.250, ")
