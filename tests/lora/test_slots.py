"""Adapters in device slots: kept while used, least recently used swapped out, never one a step needs."""

from __future__ import annotations

import pytest
from pagoda.engine.lora.slots import SlotTable


def test_lru_swapping_keeps_what_the_step_needs():
    table = SlotTable(2)
    slots, loads = table.assign([7, 8])
    assert slots == {7: 0, 8: 1} and loads == [(0, 7), (1, 8)]
    assert table.assign([8]) == ({8: 1}, [])  # resident: no copy; 8 is now the most recent
    slots, loads = table.assign([9])  # 7 is the least recently used
    assert slots == {9: 0} and loads == [(0, 9)] and table.resident == [8, 9]
    slots, loads = table.assign([7, 8])  # 8 is the least recently used, but this step needs it: 9 goes
    assert slots == {7: 0, 8: 1} and loads == [(0, 7)] and table.resident == [7, 8]
    assert (table.loads, table.evictions) == (4, 2)


def test_release_frees_the_slot_and_too_many_adapters_is_an_error():
    table = SlotTable(2)
    table.assign([1, 2])
    table.release(1)
    table.release(99)  # unknown: ignored
    assert table.assign([3]) == ({3: 0}, [(0, 3)])
    with pytest.raises(ValueError, match="3 adapters, more than the 2 slots"):
        table.assign([4, 5, 6])
    with pytest.raises(ValueError, match="at least 1"):
        SlotTable(0)
