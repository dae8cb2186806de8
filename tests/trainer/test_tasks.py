"""Synthetic tasks: seeded, split, and scored by their own rule."""

from __future__ import annotations

import pytest

from trainer.data.tasks import TASKS, get_task


@pytest.mark.parametrize("name", sorted(TASKS))
def test_examples_are_seeded_and_splits_differ(name):
    task = get_task(name)
    a = task.examples(50, seed=3)
    assert a == task.examples(50, seed=3)
    train, val = task.split(50, 50, seed=3)
    assert train == a
    assert val != train
    assert (
        len({repr(e) for e in train}) > 5
    )  # not one example repeated (lookup: 5 prompts, many tables)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_ground_truth_scores_one_and_a_wrong_answer_less(name):
    task = get_task(name)
    for ex in task.examples(20, seed=0):
        assert task.reward(ex.ground_truth, ex.ground_truth) == 1.0
        assert task.reward(ex.ground_truth + "x", ex.ground_truth) < 1.0
        assert task.reward("", ex.ground_truth) == 0.0
        assert len(ex.ground_truth) < task.max_response_length


def test_task_contents_follow_their_rule():
    for ex in get_task("repeat").examples(20, seed=1):
        digit, times = ex.prompt[0], int(ex.prompt[2])
        assert ex.prompt == f"{digit}*{times}=" and ex.ground_truth == digit * times
    for ex in get_task("reverse").examples(20, seed=1):
        digits = ex.prompt[1:-1]
        assert ex.ground_truth == digits[::-1]
    for ex in get_task("add").examples(20, seed=1):
        a, b = ex.prompt[:-1].split("+")
        assert int(ex.ground_truth) == int(a) + int(b)


def test_unknown_task_and_bad_count_are_named():
    with pytest.raises(ValueError, match="data.task='nope'.*repeat"):
        get_task("nope")
    with pytest.raises(ValueError, match="number of examples"):
        get_task("repeat").examples(0, seed=0)
