"""Which adapter sits in which device slot: a fixed number of slots, least recently used swapped out.

Every loaded adapter lives in host memory (the registry); a step's adapters must be in slots. An adapter
already in a slot stays there; a missing one takes a free slot, else the slot of the least recently used
adapter that this step does not need, and its weights are copied in from the host. The scheduler never puts
more distinct adapters into one step than there are slots (--max-loras), so there is always such a slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self._free = list(range(num_slots))
        self.loads = 0  # adapters copied into a slot, cumulative
        self.evictions = 0  # adapters swapped out of a slot to make room, cumulative

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    @property
    def resident(self) -> list[int]:
        """Adapter ids in slots, least recently used first."""
        return list(self._slot_of)

    def assign(self, adapter_ids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for one step's adapters: ({adapter id: slot}, [(slot, adapter id) to load now])."""
        wanted = list(dict.fromkeys(adapter_ids))
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step uses {len(wanted)} adapters, more than the {self.num_slots} slots")
        needed = set(wanted)
        loads: list[tuple[int, int]] = []
        for adapter_id in wanted:
            if adapter_id in self._slot_of:
                self._slot_of.move_to_end(adapter_id)
                continue
            if self._free:
                slot = self._free.pop(0)
            else:
                victim = next(a for a in self._slot_of if a not in needed)
                slot = self._slot_of.pop(victim)
                self.evictions += 1
            self._slot_of[adapter_id] = slot
            loads.append((slot, adapter_id))
            self.loads += 1
        return {a: self._slot_of[a] for a in wanted}, loads

    def release(self, adapter_id: int) -> None:
        """Free the slot of an adapter that was unloaded (unknown ids are ignored)."""
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort()
