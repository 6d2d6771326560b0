"""Launch configurations as a pure function of the device: every catalogue GPU's choice fits its shared memory.

No GPU and no compiler: what the compiled kernels really take is checked against these numbers by the
catalogue run in test_warm.py.
"""

from __future__ import annotations

import pytest
from pagoda.engine.sizing import GPU_CATALOGUE, lookup_gpu
from pagoda.kernels.launch_config import (
    INTERPRETER,
    DeviceLimits,
    decode_config,
    group_pad,
    prefill_config,
    tile_shared_memory,
)


def limits(gpu: str) -> DeviceLimits:
    spec = lookup_gpu(gpu)
    return DeviceLimits(spec.compute_capability, spec.shared_memory_per_block)


@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_every_catalogue_gpu_gets_tiles_that_fit_its_shared_memory(spec):
    device = DeviceLimits(spec.compute_capability, spec.shared_memory_per_block)
    for dtype in ("float16", "bfloat16", "float32"):
        for kv in (dtype, "int8", "float8_e4m3fn"):
            for head_dim in (64, 128, 256):
                for group in (1, 3, 4, 8, 16):
                    p = prefill_config(device, dtype, kv, head_dim, group)
                    d = decode_config(device, dtype, kv, head_dim, group)
                    cc = spec.compute_capability
                    assert p.shared_memory == tile_shared_memory(p.block_m, p.block_n, head_dim, dtype, cc)
                    assert d.shared_memory == tile_shared_memory(
                        group_pad(group), d.block_n, head_dim, dtype, cc
                    )
                    assert max(p.shared_memory, d.shared_memory) <= spec.shared_memory_per_block
                    assert p.num_warps == (8 if p.block_m == 128 else 4)


def test_tiles_shrink_where_shared_memory_is_short():
    """The fixed 128 x 64 prefill tile took 98,304 B on a T4 (65,536 allowed) and 164,352 B in float32 on
    an A10 or L4 (101,376 allowed): there the tile halves, elsewhere it stays."""
    big = (128, 64)
    assert (p := prefill_config(limits("H100"), "bfloat16", "float8_e4m3fn", 128, 4)).block_m == 128
    assert (p.block_m, p.block_n) == big
    for gpu in ("A100-80GB", "A10", "L4", "L40S"):
        p = prefill_config(limits(gpu), "bfloat16", "bfloat16", 128, 8)
        assert (p.block_m, p.block_n) == big, gpu
    t4 = prefill_config(limits("T4"), "float16", "float16", 128, 4)
    assert (t4.block_m, t4.block_n) == (64, 32) and tile_shared_memory(
        128, 64, 128, "float16", (7, 5)
    ) > 65_536
    a10 = prefill_config(limits("A10"), "float32", "float32", 128, 4)
    assert (a10.block_m, a10.block_n) == (64, 32) and tile_shared_memory(
        128, 64, 128, "float32", (8, 6)
    ) > 101_376
    assert prefill_config(limits("H100"), "float32", "float32", 128, 4).block_m == 128
    assert decode_config(limits("T4"), "float32", "float32", 256, 4).block_n == 16


def test_the_count_is_what_ampere_compiles():
    """Anchors from the compiled kernels (Triton 3.6, sm_80, 128 x 64 x 128 prefill in bfloat16: 81,920 B;
    decode of 16 heads x 64 keys: 38,912 B), plus the scratch allowance."""
    assert tile_shared_memory(128, 64, 128, "bfloat16", (8, 0)) == 81_920 + 1024
    assert tile_shared_memory(16, 64, 128, "bfloat16", (8, 0)) == 38_912 + 1024
    assert group_pad(1) == group_pad(16) == 16 and group_pad(17) == 32


def test_the_interpreter_runs_the_smallest_tiles():
    p = prefill_config(INTERPRETER, "float32", "float32", 64, 4)
    d = decode_config(INTERPRETER, "float32", "float32", 64, 4)
    assert (p.block_m, p.block_n, d.block_n) == (16, 16, 16)


def test_no_tile_that_fits_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"no prefill tile fits 4096 B .*compute capability 7\.5.*head_dim 128"
    ):
        prefill_config(DeviceLimits((7, 5), 4096), "float16", "float16", 128, 4)
