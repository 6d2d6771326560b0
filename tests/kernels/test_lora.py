"""The LoRA kernels (Triton, interpreter) and the CPU path against their torch twins, on segments that skip
slots, leave base-model rows between them and cross tile edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagoda.engine.lora.layers import LoRABatch, LoRAContext, LoRALinear, Slice
from pagoda.kernels.cpu import loader
from pagoda.kernels.launch_config import INTERPRETER, DeviceLimits, lora_config
from pagoda.kernels.lora import lora_expand, lora_shrink
from pagoda.kernels.reference import lora_expand_ref, lora_shrink_ref
from pagoda_testkit.native import cpu_variant  # noqa: F401 (a fixture: each CPU kernel variant)

SLOTS, RANK = 3, 8
SLICES = [Slice("q_proj", 0, 24), Slice("k_proj", 24, 8), Slice("v_proj", 32, 8)]
IN, OUT = 40, 40


def _segments(starts, lens, slots):
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return t(starts), t(lens), t(slots)


def _weights(dtype, gen):
    a = (torch.randn((SLOTS, IN, len(SLICES) * RANK), generator=gen) * 0.3).to(dtype)
    b = [(torch.randn((SLOTS, RANK, s.size), generator=gen) * 0.3).to(dtype) for s in SLICES]
    return a, b


def _tol(dtype):
    # bfloat16 under the interpreter: its float32 -> bfloat16 store truncates (REFERENCE.md), one ulp
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 0.5}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_shrink_and_expand_match_the_twins(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((23, IN), generator=gen).to(dtype)
    a, b = _weights(dtype, gen)
    # slot 1 unused; rows 20.. are the base model's; a 17-row segment crosses the 16-row tile
    seg = _segments([0, 17, 19], [17, 2, 1], [2, 0, 2])
    h = lora_shrink(x, a, *seg, max_seg_len=17)
    h_ref = lora_shrink_ref(x, a, *seg)
    torch.testing.assert_close(h, h_ref, atol=1e-4 if dtype == torch.float32 else 2e-3, rtol=1e-3)
    assert h[20:].abs().sum() == 0
    y = torch.randn((23, OUT), generator=gen).to(dtype)
    y_ref, before = y.clone(), y.clone()
    for i, s in enumerate(SLICES):
        cols = slice(s.offset, s.offset + s.size)
        lora_expand(h_ref, b[i], y[:, cols], *seg, max_seg_len=17, h_offset=i * RANK)
        lora_expand_ref(h_ref, b[i], y_ref[:, cols], *seg, h_offset=i * RANK)
    assert (y.float() - y_ref.float()).abs().max() <= _tol(dtype)
    assert torch.equal(y[20:], before[20:])  # base-model rows untouched
    assert (y[:20].float() - before[:20].float()).abs().max() > 0.1


def test_no_segments_is_a_no_op():
    x, y = torch.randn(4, IN), torch.randn(4, 8)
    empty = _segments([], [], [])
    a = torch.randn(SLOTS, IN, RANK)
    assert lora_shrink(x, a, *empty, max_seg_len=0).abs().sum() == 0
    before = y.clone()
    lora_expand(torch.zeros(4, RANK), torch.randn(SLOTS, RANK, 8), y, *empty, max_seg_len=0)
    assert torch.equal(y, before)


def _cpu_case(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lora = LoRALinear(IN, SLICES, SLOTS, RANK, LoRAContext(), dtype, torch.device("cpu"))
    a, b = _weights(dtype, gen)
    lora.a.copy_(a)
    for i in range(len(SLICES)):
        lora.b[i].copy_(b[i])
    # slot 1 unused, base rows last (the runner's order); 11 rows of slot 0 cross the C kernel's 8-row tile
    rows = np.asarray([0] * 11 + [2] * 3 + [-1] * 4)
    lora.context.batch = LoRABatch.from_rows(rows, SLOTS, torch.device("cpu"))
    x = torch.randn((len(rows), IN), generator=gen).to(dtype)
    y = torch.randn((len(rows), OUT), generator=gen).to(dtype)
    batch = lora.context.batch
    seg = (batch.seg_starts, batch.seg_lens, batch.seg_slots)
    y_ref = y.clone()
    h = lora_shrink_ref(x, a, *seg)
    for i, s in enumerate(SLICES):
        lora_expand_ref(h, b[i], y_ref[:, s.offset : s.offset + s.size], *seg, h_offset=i * RANK)
    return lora, x, y, y_ref


@pytest.mark.usefixtures("cpu_variant")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_matches_the_twins(dtype):
    lora, x, y, y_ref = _cpu_case(dtype)
    before = y.clone()
    lora.apply(x, y)
    # float32: the same sums in another order; bfloat16: both round once from float32 (ties may differ)
    tol = 1e-5 if dtype == torch.float32 else 0.07
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=1e-2 if tol > 1e-5 else 1e-5)
    assert torch.equal(y[14:], before[14:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback_matches_the_twins(dtype):
    lora, x, y, y_ref = _cpu_case(dtype)
    with loader.using(loader.CpuKernels(loader.TORCH, "", reason="test: the torch path")):
        lora.apply(x, y)
    tol = 1e-5 if dtype == torch.float32 else 0.1  # bfloat16: h is rounded to bfloat16 between the products
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(y[14:], y_ref[14:])


def test_rows_must_be_grouped_by_slot_with_base_rows_last():
    cpu = torch.device("cpu")
    assert LoRABatch.from_rows(np.asarray([-1, -1]), 2, cpu) is None
    batch = LoRABatch.from_rows(np.asarray([0, 0, 1, -1]), 2, cpu)
    assert batch.num_tokens == 3 and batch.segments == [(0, 2, 0), (2, 1, 1)]
    assert (batch.seg_starts.tolist(), batch.seg_lens.tolist(), batch.max_seg_len) == ([0, 2], [2, 1], 2)
    for rows in ([1, 0], [0, -1, 0]):
        with pytest.raises(ValueError, match="grouped by slot"):
            LoRABatch.from_rows(np.asarray(rows), 2, cpu)


@pytest.mark.parametrize("cc,smem", [((7, 5), 65536), ((8, 0), 166912), ((9, 0), 232448)])
def test_launch_configurations_fit_every_catalogue_gpu(cc, smem):
    limits = DeviceLimits(cc, smem)
    for dtype in ("float16", "bfloat16", "float32"):
        for kind, width in (("shrink", 3 * 512), ("expand", 512), ("shrink", 4), ("expand", 4)):
            config = lora_config(limits, dtype, kind, width)
            assert config.shared_memory <= smem
            assert min(config.block_m, config.block_n, config.block_k) >= 16  # tl.dot's least
    assert lora_config(INTERPRETER, "float32", "shrink", 48).block_n == 64
    with pytest.raises(ValueError, match="kind"):
        lora_config(limits, "float16", "sideways", 8)
