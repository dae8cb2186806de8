import pytest

from gpusched.inventory import (
    Card,
    InventoryError,
    parse_simulate_spec,
    select_cards,
    visible_filter,
)


def test_simulate_spec_forms():
    assert parse_simulate_spec("2") == [Card("0"), Card("1")]
    assert parse_simulate_spec("2:80GB") == [Card("0", 80 * 10**9), Card("1", 80 * 10**9)]
    assert [c.memory for c in parse_simulate_spec("3:80GB,80GB,40GB")] == [8e10, 8e10, 4e10]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0:80GB,x", "memory 'x'"),
        ("two", "'two' is not a card count"),
        ("-1", "negative"),
        ("3:80GB,40GB", "3 cards but 2 memory sizes"),
    ],
)
def test_bad_simulate_specs_name_the_spec(spec, message):
    with pytest.raises(InventoryError, match=message) as info:
        parse_simulate_spec(spec)
    assert repr(spec) in str(info.value)


def test_select_cards_by_id_and_errors():
    inventory = parse_simulate_spec("4")
    assert [c.id for c in select_cards(inventory, ["3", "1"])] == ["3", "1"]
    with pytest.raises(
        InventoryError, match=r"card\(s\) 7 that do not exist \(available: 0,1,2,3\)"
    ):
        select_cards(inventory, ["1", "7"])


def test_outer_cuda_visible_devices_by_index_and_uuid():
    physical = [Card("0", 1), Card("1", 2), Card("2", 3)]
    uuids = {"0": "GPU-aaa", "1": "GPU-bbb", "2": "GPU-ccc"}
    assert [c.id for c in visible_filter(physical, uuids, "2,0")] == ["2", "0"]
    assert [c.id for c in visible_filter(physical, uuids, "GPU-bbb")] == ["1"]
    assert visible_filter(physical, uuids, "") == []
    # Like CUDA: enumeration stops at the first entry naming no card.
    assert [c.id for c in visible_filter(physical, uuids, "1,9,2")] == ["1"]
    assert visible_filter(physical, uuids, None) == physical
