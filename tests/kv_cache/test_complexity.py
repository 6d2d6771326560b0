"""The allocation and release paths are O(1) in the pool size: counted in executed lines, not timed.

Each scenario runs on a small and a large pool; the number of Python lines executed inside
``pagoda.engine.kv_cache`` must be the same, so no path scans the blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pagoda.engine.kv_cache as kv_cache_pkg
import pytest
from pagoda.engine.kv_cache.manager import KVCacheManager

PKG_DIR = str(Path(kv_cache_pkg.__file__).parent)
SMALL, LARGE = 64, 16384
BS = 2


def count_lines(fn: Callable[[], object]) -> int:
    """Lines executed in the kv_cache package while ``fn`` runs."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PKG_DIR) else None

    old = sys.gettrace()
    sys.settrace(global_)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def pool_full_of_cached_blocks(num_blocks: int) -> KVCacheManager:
    """Every block holds a cached prefix and nobody references it: allocation must evict."""
    m = KVCacheManager(num_blocks, BS)
    tokens = list(range(num_blocks * BS))
    assert m.allocate_slots("filler", len(tokens))
    m.cache_blocks("filler", tokens, len(tokens))
    m.free("filler")
    assert m.num_cached_blocks == num_blocks
    return m


def half_used(num_blocks: int) -> KVCacheManager:
    m = KVCacheManager(num_blocks, BS)
    assert m.allocate_slots("other", num_blocks // 2 * BS)
    return m


SCENARIOS: dict[str, tuple[Callable[[int], KVCacheManager], Callable[[KVCacheManager], object]]] = {
    "allocate from empty blocks": (half_used, lambda m: m.allocate_slots("s", 4 * BS)),
    "allocate by evicting cached blocks": (
        pool_full_of_cached_blocks,
        lambda m: m.allocate_slots("s", 4 * BS),
    ),
    "free": (
        half_used,
        lambda m: (
            m.allocate_slots("s", 4 * BS),
            m.cache_blocks("s", list(range(4 * BS)), 4 * BS),
            m.free("s"),
        ),
    ),
    "prefix hit": (pool_full_of_cached_blocks, lambda m: m.get_computed_tokens("s", list(range(4 * BS + 1)))),
    "fork and copy on write": (
        half_used,
        lambda m: (m.allocate_slots("p", 3), m.fork("p", "c"), m.allocate_slots("c", 4), m.free("p")),
    ),
    "usage": (half_used, lambda m: (m.num_free_blocks, m.num_used_blocks, m.num_cached_blocks, m.usage)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_operation_count_does_not_grow_with_pool_size(name):
    make, op = SCENARIOS[name]
    small, large = make(SMALL), make(LARGE)
    n_small = count_lines(lambda: op(small))
    n_large = count_lines(lambda: op(large))
    assert n_small > 0
    assert n_small == n_large, f"{name}: {n_small} lines on {SMALL} blocks, {n_large} on {LARGE}"
    small.check_invariants()


def test_the_counter_sees_a_scan():
    """The yardstick itself: a full check walks every block, so its count grows with the pool."""
    small, large = half_used(SMALL), half_used(LARGE)
    assert count_lines(large.check_invariants) > 10 * count_lines(small.check_invariants)
