import pytest

from gpusched.requirements import (
    Requirement,
    RequirementError,
    parse_memory,
    requirement_from_glob_value,
    requirement_from_marker,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("40GB", 40 * 10**9),
        ("80GiB", 80 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5G", 1_500_000_000),
        (1024, 1024),
    ],
)
def test_parse_memory_units(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["forty", "40XB", "", "-1GB", 0, True, 3.5, "GB"])
def test_parse_memory_rejects_with_the_value_named(bad):
    with pytest.raises(RequirementError, match="memory"):
        parse_memory(bad)


def test_marker_forms():
    assert requirement_from_marker("gpu", (2,), {}) == Requirement(2)
    assert requirement_from_marker("gpu", (), {"n": 1, "memory": "40GB"}) == Requirement(
        1, 40 * 10**9
    )
    assert requirement_from_marker("gpu4", (), {}) == Requirement(4)
    assert requirement_from_marker("gpu8", (), {"memory": "80GB"}) == Requirement(8, 80 * 10**9)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((-1,), {}, "negative"),
        (("two",), {}, "not an integer"),
        ((True,), {}, "not an integer"),
        ((), {}, "needs a count"),
        ((1, 2), {}, "one count"),
        ((1,), {"memory": "lots"}, "memory 'lots'"),
        ((1,), {"mem": "40GB"}, "unknown arguments"),
    ],
)
def test_bad_gpu_markers(args, kwargs, message):
    with pytest.raises(RequirementError, match=message):
        requirement_from_marker("gpu", args, kwargs)


def test_combine_takes_the_maximum_of_each():
    combined = Requirement(1, 80 * 10**9).combine(Requirement(4, None))
    assert combined == Requirement(4, 80 * 10**9)


def test_glob_values():
    assert requirement_from_glob_value("tests/multi/*", 2) == Requirement(2)
    assert requirement_from_glob_value("x", {"gpus": 1, "memory": "40GB"}) == Requirement(
        1, 4 * 10**10
    )
    with pytest.raises(RequirementError, match=r"\[tool.gpusched.gpus\] 'x'"):
        requirement_from_glob_value("x", "two")
    with pytest.raises(RequirementError, match="missing 'gpus'"):
        requirement_from_glob_value("x", {"memory": "1GB"})
