"""Reward rules and loading user reward functions by name."""

from __future__ import annotations

import math
import textwrap

import pytest

from trainer.data.rewards import char_match, exact_match, load_reward_fn, score


def test_char_match_hand_computed():
    assert char_match("333", "333") == 1.0
    assert char_match("33", "333") == pytest.approx(2 / 3)
    assert char_match("3333", "333") == pytest.approx(3 / 4)
    assert char_match("343", "333") == pytest.approx(2 / 3)
    assert char_match("", "12") == 0.0
    assert char_match("", "") == 1.0
    assert char_match("33 ", "33") == pytest.approx(2 / 3)  # whitespace is not free


def test_exact_match():
    assert exact_match(" 12 ", "12") == 1.0
    assert exact_match("13", "12") == 0.0


def test_load_by_dotted_path_and_module_colon_name():
    assert load_reward_fn("trainer.data.rewards.exact_match") is exact_match
    assert load_reward_fn("trainer.data.rewards:char_match") is char_match


def test_load_from_a_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        textwrap.dedent(
            """
            def contains(completion, ground_truth, **extra):
                return float(ground_truth in completion)
            def bad(x):
                return 1.0
            """
        )
    )
    fn = load_reward_fn(f"{f}:contains")
    assert fn("xx42", "42") == 1.0 and fn("x", "42") == 0.0
    with pytest.raises(TypeError, match="must accept"):
        load_reward_fn(f"{f}:bad")
    with pytest.raises(AttributeError, match="no callable 'missing'"):
        load_reward_fn(f"{f}:missing")
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        load_reward_fn(f"{tmp_path}/nowhere.py:contains")


@pytest.mark.parametrize("spec", ["", "justaname", "no_such_module_xyz:fn"])
def test_bad_specs_name_the_spec(spec):
    with pytest.raises((ValueError, ImportError), match="reward.function"):
        load_reward_fn(spec)


def test_score_checks_range_and_type():
    assert score(lambda c, g, **e: 0.5, "a", "b") == 0.5
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        score(lambda c, g, **e: 1.5, "a", "b")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        score(lambda c, g, **e: math.nan, "a", "b")
    with pytest.raises(TypeError, match="expected a float"):
        score(lambda c, g, **e: "high", "a", "b")
