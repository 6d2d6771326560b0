"""The loader pass (engine/quantization/convert.py) turns each format's packed tensors into the canonical
layouts, whose dequantized weight is the one the format stands for; the packing the tests use is checked
against the compressed-tensors library's own and, for GPTQ and AWQ, element by element against the layouts'
written definitions. The quantized linears place fused parts and tensor-parallel slices, and refuse a slice
that cuts a group; block-wise FP8 parts that cut the fused grid are held per row."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from pagoda.engine.models.layers import Linear, dequantize_linears
from pagoda.engine.quantization import packing
from pagoda.engine.quantization.convert import canonical_tensors
from pagoda.engine.quantization.detect import detect_quantization
from pagoda.engine.quantization.linear import Fp8Linear, Int4Linear
from pagoda_testkit.quant_checkpoints import (
    AWQ_ORDER,
    FORMATS,
    quantization_config,
    quantize_int4,
    quantize_module,
)
from torch import nn

N, K = 64, 256


def weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.2


def converted(fmt: str, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
    scheme = detect_quantization({"quantization_config": quantization_config(fmt)})
    named = [(f"model.layers.0.mlp.down_proj.{k}", v) for k, v in tensors.items()]
    return {n.rsplit(".", 1)[1]: t for n, t in canonical_tensors(named, scheme, dtype)}


def dequantized(fmt: str, canon: dict[str, torch.Tensor]) -> torch.Tensor:
    if "qweight" in canon:
        zeros = canon.get("zeros", torch.full(canon["scales"].shape, 8, dtype=torch.uint8))
        if "g_idx" in canon:  # act-order: each column's own group
            g = canon["g_idx"]
            q = packing.unpack_int4(canon["qweight"]).float()
            return (q - zeros.float()[:, g]) * canon["scales"].float()[:, g]
        return packing.dequantize_int4(canon["qweight"], canon["scales"], zeros, torch.float32)
    scheme = detect_quantization({"quantization_config": quantization_config(fmt)})
    return packing.dequantize_fp8(canon["weight"], canon["weight_scale"], scheme.block, torch.float32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_converts_to_the_weight_it_stands_for(fmt) -> None:
    w = weight(1, 128, K)
    tensors, reference = quantize_module(fmt, w)
    canon = converted(fmt, tensors)
    assert set(canon) <= {"qweight", "scales", "zeros", "weight", "weight_scale", "g_idx"}
    assert ("g_idx" in canon) == (fmt == "gptq-act-order")  # a g_idx in group order is dropped
    assert torch.equal(dequantized(fmt, canon), reference)  # exactly: same float32 products
    err = (reference - w).abs().max() / w.abs().max()
    assert 0 < err < (0.13 if "int4" in fmt or "gptq" in fmt or fmt == "awq" else 0.07)  # quantized, not lost


def test_compressed_tensors_packing_is_the_librarys() -> None:
    q, s, z = quantize_int4(weight(2), 128, False, torch.bfloat16)
    ours, _ = quantize_module("ct-int4-asym", weight(2))
    signed = (q.to(torch.int16) - 8).to(torch.int8)
    assert torch.equal(ours["weight_packed"], pack_to_int32(signed, 4, packed_dim=1))
    zp = (z.to(torch.int16) - 8).to(torch.int8)
    assert torch.equal(ours["weight_zero_point"], pack_to_int32(zp, 4, packed_dim=0))
    # and the engine's unpacking of the library's packing gives the library's unpacking (+ 8)
    canon = converted("ct-int4-asym", ours)
    assert torch.equal(packing.unpack_int4(canon["qweight"]).to(torch.int16) - 8, signed.to(torch.int16))
    lib_zp = unpack_from_int32(ours["weight_zero_point"], 4, torch.Size(z.shape), packed_dim=0)
    assert torch.equal(canon["zeros"].to(torch.int16) - 8, lib_zp.to(torch.int16))


def nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def test_gptq_and_awq_packing_follow_their_layouts_element_by_element() -> None:
    w = weight(3)
    gptq, _ = quantize_module("gptq-asym-v2", w)
    awq, _ = quantize_module("awq", w)
    q, _, z = quantize_int4(w, 128, False, torch.float16)
    gen = torch.Generator().manual_seed(4)
    for n, k in torch.randint(0, min(N, K), (40, 2), generator=gen).tolist():
        k = k * (K // N)
        # GPTQ: input rows packed down the columns, 8 per word, row 8r + i in nibble i
        assert nibble(int(gptq["qweight"][k // 8, n]), k % 8) == q[n, k]
        assert nibble(int(gptq["qzeros"][k // 128, n // 8]), n % 8) == z[n, k // 128]
        # AWQ: output columns packed along the rows, column 8c + ORDER[i] in nibble i
        i = AWQ_ORDER.index(n % 8)
        assert nibble(int(awq["qweight"][k, n // 8]), i) == q[n, k]
        assert nibble(int(awq["qzeros"][k // 128, n // 8]), i) == z[n, k // 128]
    v1, _ = quantize_module("gptq", w)  # the original format: zero - 1 stored (symmetric: 7 for 8)
    assert all(nibble(int(v1["qzeros"][0, 0]), i) == 7 for i in range(8))
    assert torch.equal(converted("gptq", v1)["zeros"], torch.full((N, K // 128), 8, dtype=torch.uint8))


def test_an_act_order_checkpoint_runs_with_its_columns_sorted_by_group() -> None:
    w = weight(5)
    tensors, reference = quantize_module("gptq-act-order", w)
    canon = converted("gptq-act-order", tensors)
    lin = Int4Linear(K, N, False, torch.float32, torch.device("cpu"), 128, False)
    for kind, t in canon.items():
        lin.load_part(kind, t, 0, N, None)
    lin.finish_loading()
    assert lin.perm is not None and torch.equal(lin.g_idx[lin.perm], torch.arange(K) // 128)
    assert torch.equal(lin.dequantize(torch.float32), reference)  # back in the checkpoint's column order
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), x @ reference.T)
    # fused parts share their input, hence their order
    other = canon["g_idx"].roll(1)
    with pytest.raises(ValueError, match="fused parts of one linear .* different act orders"):
        lin.load_part("g_idx", other, 0, N, None)
    # a row-parallel layer split over ranks would spread each group over the ranks
    split = Int4Linear(K // 2, N, False, torch.float32, torch.device("cpu"), 128, False)
    with pytest.raises(ValueError, match="act-order checkpoint .* cannot split o_proj / down_proj"):
        split.load_part("g_idx", canon["g_idx"], 0, N, (1, list(range(K // 2))))
    uneven = Int4Linear(K, N, False, torch.float32, torch.device("cpu"), 128, False)
    uneven.load_part("g_idx", torch.zeros(K, dtype=torch.int64), 0, N, None)
    with pytest.raises(ValueError, match="does not give each group of 128 columns exactly its size"):
        uneven.finish_loading()


def test_static_kv_cache_scales_are_dropped() -> None:
    scheme = detect_quantization({"quantization_config": quantization_config("ct-fp8-tensor")})
    named = [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)), ("model.norm.weight", torch.ones(4))]
    assert [n for n, _ in canonical_tensors(named, scheme, torch.float32)] == ["model.norm.weight"]


def test_a_quantized_lm_head_is_dequantized_for_the_dense_head() -> None:
    w = weight(6, 128, K)
    tensors, reference = quantize_module("gptq", w)
    scheme = detect_quantization({"quantization_config": quantization_config("gptq") | {"lm_head": True}})
    out = dict(canonical_tensors([(f"lm_head.{k}", v) for k, v in tensors.items()], scheme, torch.float32))
    assert list(out) == ["lm_head.weight"] and torch.equal(out["lm_head.weight"], reference)


def int4_linear(fmt: str, w: torch.Tensor, bias: bool = False) -> tuple[Int4Linear, torch.Tensor]:
    scheme = detect_quantization({"quantization_config": quantization_config(fmt)})
    tensors, reference = quantize_module(fmt, w)
    lin = Int4Linear(w.shape[1], w.shape[0], bias, torch.float32, torch.device("cpu"), 128, scheme.symmetric)
    for kind, t in converted(fmt, tensors).items():
        lin.load_part(kind, t, 0, w.shape[0], None)
    return lin, reference


def test_quantized_linears_run_their_dequantized_weight_and_become_dense_on_the_cpu() -> None:
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(7))
    lin, reference = int4_linear("awq", weight(8))
    torch.testing.assert_close(lin(x), x @ reference.T)
    tensors, fp8_ref = quantize_module("ct-fp8-block", weight(9, 128, K))
    fp8 = Fp8Linear(K, 128, False, torch.float32, torch.device("cpu"), 128, (128, 128))
    for kind, t in converted("ct-fp8-block", tensors).items():
        fp8.load_part(kind, t, 0, 128, None)
    torch.testing.assert_close(fp8(x), x @ fp8_ref.T)
    holder = nn.Sequential(lin, fp8)
    assert dequantize_linears(holder) == 2
    assert isinstance(holder[0], Linear) and torch.equal(holder[0].weight, reference)
    assert isinstance(holder[1], Linear) and torch.equal(holder[1].weight, fp8_ref)


def test_fused_parts_keep_their_own_per_tensor_fp8_scales() -> None:
    a, b = weight(10, 32, K), weight(11, 16, K) * 5  # very different ranges
    fused = Fp8Linear(K, 48, False, torch.float32, torch.device("cpu"), 0, None)
    refs = []
    for offset, w in ((0, a), (32, b)):
        tensors, ref = quantize_module("ct-fp8-tensor", w)
        for kind, t in converted("ct-fp8-tensor", tensors).items():
            assert fused.load_part(kind, t, offset, w.shape[0], None) == w.shape[0]
        refs.append(ref)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat(refs))


def test_tensor_parallel_slices_cut_whole_groups_only() -> None:
    w = weight(12)
    tensors, reference = quantize_module("ct-int4-asym", w)
    canon = converted("ct-int4-asym", tensors)
    half = Int4Linear(K // 2, N, False, torch.float32, torch.device("cpu"), 128, False)
    for kind, t in canon.items():  # the second rank's columns of a row-parallel layer (o_proj, down_proj)
        half.load_part(kind, t, 0, N, (1, list(range(K // 2, K))))
    assert torch.equal(half.dequantize(torch.float32), reference[:, K // 2 :])
    rows = Int4Linear(K, N // 2, False, torch.float32, torch.device("cpu"), 128, False)
    for kind, t in canon.items():  # a column-parallel layer's rows
        rows.load_part(kind, t, 0, N // 2, (0, list(range(N // 2))))
    assert torch.equal(rows.dequantize(torch.float32), reference[: N // 2])
    cut = Int4Linear(K // 4, N, False, torch.float32, torch.device("cpu"), 64, False)
    with pytest.raises(ValueError, match="tensor parallelism cuts groups of 64 input features"):
        cut.load_part("scales", canon["scales"], 0, N, (1, list(range(32, 96))))


def test_fp8_blocks_are_placed_and_sliced_whole() -> None:
    tensors, reference = quantize_module("ct-fp8-block", weight(13, 256, K))
    canon = converted("ct-fp8-block", tensors)
    cols = Fp8Linear(K // 2, 256, False, torch.float32, torch.device("cpu"), 128, (128, 128))
    for kind, t in canon.items():  # a row-parallel layer's second half of the columns: one block column
        assert cols.load_part(kind, t, 0, 256, (1, list(range(K // 2, K)))) == (
            2 if kind == "weight_scale" else 256
        )
    assert torch.equal(cols.dequantize(torch.float32), reference[:, K // 2 :])
    rows = Fp8Linear(K, 128, False, torch.float32, torch.device("cpu"), 128, (128, 128))
    for kind, t in canon.items():  # the second block row
        rows.load_part(kind, t, 0, 128, (0, list(range(128, 256))))
    assert torch.equal(rows.dequantize(torch.float32), reference[128:])
    assert rows.block == (128, 128) and rows.weight_scale.shape == (1, 2)  # aligned: the compact grid


def fp8_block_parts(sizes: tuple[int, ...], seed: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Each part quantized on its own 128 x 128 grid (from its own row 0), as llm-compressor does."""
    out = []
    for i, rows in enumerate(sizes):
        tensors, ref = quantize_module("ct-fp8-block", weight(seed + i, rows, K))
        out.append((converted("ct-fp8-block", tensors), ref))
    return out


@pytest.mark.parametrize(
    ("sizes", "order"),
    [
        ((192, 64, 64), (0, 1, 2)),  # q 1.5 blocks: k and v start inside blocks (SmolLM2: 576, 192, 192)
        ((192, 64, 64), (2, 0, 1)),  # v on the grid (rows 256..319, the last part) first, then q switches
        ((128, 64, 128), (0, 1, 2)),  # q a whole block on the grid, then k switches
        ((320, 320), (1, 0)),  # gate/up of an intermediate size of 2.5 blocks
    ],
)
def test_fused_parts_that_cut_fp8_blocks_keep_their_own_blocks(sizes, order) -> None:
    parts = fp8_block_parts(sizes, 20)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    fused = Fp8Linear(K, sum(sizes), False, torch.float32, torch.device("cpu"), 128, (128, 128))
    counted = {"weight": 0, "weight_scale": 0}
    for i in order:
        for kind, t in parts[i][0].items():
            counted[kind] += fused.load_part(kind, t, offsets[i], sizes[i], None)
    # the loader's check: every row of each parameter written
    assert counted == {"weight": sum(sizes), "weight_scale": sum(sizes)}
    assert fused.block == (1, 128) and tuple(fused.weight_scale.shape) == (sum(sizes), 2)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([ref for _, ref in parts]))


def test_fused_parts_on_whole_blocks_keep_the_grid() -> None:
    sizes = (256, 128, 128)
    parts = fp8_block_parts(sizes, 30)
    fused = Fp8Linear(K, 512, False, torch.float32, torch.device("cpu"), 128, (128, 128))
    counted = 0
    for (tensors, _), offset, rows in zip(parts, (0, 256, 384), sizes, strict=True):
        for kind, t in tensors.items():
            n = fused.load_part(kind, t, offset, rows, None)
            counted += n if kind == "weight_scale" else 0
    assert counted == 4 and fused.block == (128, 128) and tuple(fused.weight_scale.shape) == (4, 2)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([ref for _, ref in parts]))


def test_tensor_parallel_rows_that_cut_fp8_blocks_are_held_per_row() -> None:
    tensors, reference = quantize_module("ct-fp8-block", weight(14, 192, K))
    canon = converted("ct-fp8-block", tensors)
    for lo, hi, block in ((0, 96, (128, 128)), (96, 192, (1, 128))):  # two ranks of a 1.5-block part
        rank = Fp8Linear(K, hi - lo, False, torch.float32, torch.device("cpu"), 128, (128, 128))
        for kind, t in canon.items():
            rank.load_part(kind, t, 0, hi - lo, (0, list(range(lo, hi))))
        assert rank.block == block
        assert torch.equal(rank.dequantize(torch.float32), reference[lo:hi])
    fused = Fp8Linear(K, 256, False, torch.float32, torch.device("cpu"), 128, (128, 128))
    with pytest.raises(ValueError, match="weight_scale has 1 block rows, expected 2 for 192 rows"):
        fused.load_part("weight_scale", canon["weight_scale"][:1], 64, 192, None)


@pytest.mark.parametrize(
    ("parts", "sizes"),
    [
        (("q_proj", "k_proj", "v_proj"), (192, 64, 64)),  # cut: held per row
        (("q_proj", "k_proj", "v_proj"), (256, 128, 128)),  # on the grid
        (("gate_proj", "up_proj"), (320, 320)),  # cut: held per row
    ],
)
def test_the_planner_counts_the_bytes_a_fused_fp8_block_linear_holds(parts, sizes) -> None:
    from pagoda.engine.sizing.weight_format import Linear as Planned
    from pagoda.engine.sizing.weight_format import scheme_format

    loaded = fp8_block_parts(sizes, 40)
    fused = Fp8Linear(K, sum(sizes), False, torch.float32, torch.device("cpu"), 128, (128, 128))
    for (tensors, _), offset, rows in zip(
        loaded, [sum(sizes[:i]) for i in range(len(sizes))], sizes, strict=True
    ):
        for kind, t in tensors.items():
            fused.load_part(kind, t, offset, rows, None)
    held = fused.weight.numel() * fused.weight.element_size()
    held += fused.weight_scale.numel() * fused.weight_scale.element_size()
    module = "self_attn" if parts[0] == "q_proj" else "mlp"
    scheme = detect_quantization({"quantization_config": quantization_config("ct-fp8-block")})
    planned = [
        Planned(f"model.layers.0.{module}.{p}", 1, rows, K) for p, rows in zip(parts, sizes, strict=True)
    ]
    assert scheme_format(scheme, planned).quantized_bytes == held
