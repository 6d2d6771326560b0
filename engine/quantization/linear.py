"""Linears over quantized weights held in the canonical layouts (engine/quantization/packing.py).

On CUDA (and on the Triton path under the interpreter: `triton`) they run the GPU kernels
(pagoda.kernels.quant_w4a16 / quant_fp8, imported when first used; where those are missing, the weight is
dequantized per call). On the CPU the model replaces them after loading by dense
linears over their weights dequantized once to the compute dtype (`dense_on_cpu`; engine/models/layers.py
`dequantize_linears`): the CPU runs FP8 and INT4 checkpoints dequantized, and GGUF blocks are its quantized
path (gguf_linear.py).

Every quantized linear takes its tensors through `load_part(kind, tensor, offset, rows, part) -> rows
written`: ``offset``/``rows`` place a fused part (q/k/v, gate/up) along the output rows; ``part`` is this
tensor-parallel rank's slice of the checkpoint tensor, (0, output rows) or (1, input columns), the latter cut
by whole groups / blocks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.engine.quantization import packing
from pagoda.engine.quantization.scheme import QuantScheme
from torch import nn

Part = tuple[int, list[int]] | None


def quantized_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    scheme: QuantScheme,
) -> nn.Module:
    """The quantized linear of ``scheme``'s format (make_linear in engine/models/layers.py picks dense ones)."""
    if scheme.format == "int4":
        return Int4Linear(in_features, out_features, bias, dtype, device, scheme.group_size, scheme.symmetric)
    if scheme.format == "fp8":
        return Fp8Linear(in_features, out_features, bias, dtype, device, scheme.group_size, scheme.block)
    if scheme.format == "gguf":
        from pagoda.engine.quantization.gguf_linear import GGUFLinear

        return GGUFLinear(in_features, out_features, bias, dtype, device)
    raise ValueError(f"unknown quantization format {scheme.format!r}")


def _span(indices: list[int], unit: int, what: str) -> tuple[int, int]:
    """[lo, hi) of contiguous ``indices`` in whole ``unit``s (lo / unit, hi / unit)."""
    lo, hi = indices[0], indices[-1] + 1
    if hi - lo != len(indices) or lo % unit or hi % unit:
        raise ValueError(
            f"tensor parallelism cuts {what} of {unit} input features (this rank's columns {lo}..{hi - 1}): "
            "use a tensor-parallel size that divides the layer by whole groups"
        )
    return lo // unit, hi // unit


class _QuantizedLinear(nn.Module):
    dense_on_cpu = True  # the model swaps it for a dense Linear over dequantize() on the CPU ...
    triton = (
        False  # ... unless the model runs the Triton path (set by the model: the GPU's, or the interpreter)
    )

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        )
        self.lora = None  # pagoda.engine.lora.layers.LoRALinear when the engine serves LoRA adapters

    def _param(self, kind: str) -> torch.Tensor:
        target = getattr(self, kind, None) if kind in self.kinds else None
        if not isinstance(target, torch.Tensor):
            raise KeyError(kind)
        return target

    def _copy_rows(self, dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, self.in_features))
        y = y.reshape(*shape[:-1], self.out_features)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)


class Int4Linear(_QuantizedLinear):
    """W4A16: 4-bit weights in groups of ``group_size`` input features (-1: one group per row) with a scale and
    a zero point per group."""

    kinds = ("qweight", "scales", "zeros", "bias", "g_idx")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group_size: int,
        symmetric: bool,
    ):
        super().__init__(in_features, out_features, bias, dtype, device)
        g = in_features if group_size <= 0 else group_size
        if in_features % g or in_features % 2:
            raise ValueError(
                f"an INT4 linear of {in_features} input features is not a whole number of groups of {g}"
            )
        self.group_size, self.symmetric = group_size, symmetric
        groups = in_features // g
        self.qweight = nn.Parameter(
            torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device), False
        )
        # the kernels read scales in the compute dtype; the CPU dequantizes once, from float32 scales
        scale_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        self.scales = nn.Parameter(torch.empty(out_features, groups, dtype=scale_dtype, device=device), False)
        zeros = torch.full((out_features, groups), 8, dtype=torch.uint8, device=device)
        if symmetric:  # no zero points in the checkpoint: a buffer of eights
            self.register_buffer("zeros", zeros)
        else:
            self.zeros = nn.Parameter(zeros, False)
        # act-order (GPTQ desc_act, compressed-tensors actorder "group"): each input column's group, from the
        # checkpoint; `finish_loading` sorts the columns by group and keeps the order in `perm`
        self.register_buffer("g_idx", torch.empty(0, dtype=torch.int64, device=device))
        self.perm: torch.Tensor | None = None

    @property
    def _group(self) -> int:
        return self.in_features if self.group_size <= 0 else self.group_size

    def load_part(self, kind: str, tensor: torch.Tensor, offset: int, rows: int, part: Part) -> int:
        """Copy a canonical tensor (or this rank's slice of it) into rows [offset, offset + rows)."""
        if kind == "g_idx":
            return self._load_g_idx(tensor, rows, part)
        dest = self._param(kind)
        if part is not None:
            dim, indices = part
            if dim == 0:
                tensor = tensor.index_select(0, torch.tensor(indices, dtype=torch.long))
            elif kind == "qweight":  # whole groups (per channel: whole packed pairs)
                lo, hi = _span(indices, self.group_size if self.group_size > 0 else 2, "groups")
                tensor = tensor[:, indices[0] // 2 : (indices[-1] + 1) // 2]
            elif kind in ("scales", "zeros") and self.group_size > 0:
                lo, hi = _span(indices, self.group_size, "groups")
                tensor = tensor[:, lo:hi]
        self._copy_rows(dest.narrow(0, offset, rows), tensor, kind)
        return rows

    def _load_g_idx(self, g_idx: torch.Tensor, rows: int, part: Part) -> int:
        """An act-order checkpoint's column groups (the converter passes only those not in order). Fused parts
        share their input, so their orders must agree; a row-parallel layer split over ranks is refused (its
        groups are spread over every rank's columns)."""
        if part is not None and part[0] == 1:
            raise ValueError(
                "an act-order checkpoint (g_idx not in order) cannot split o_proj / down_proj over "
                "tensor-parallel ranks: use tensor_parallel_size 1 or a checkpoint quantized without act-order"
            )
        g_idx = g_idx.to(device=self.g_idx.device, dtype=torch.int64)
        if g_idx.shape != (self.in_features,):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({self.in_features},)")
        if self.g_idx.numel() and not torch.equal(self.g_idx, g_idx):
            raise ValueError(
                "the fused parts of one linear (q/k/v or gate/up) have different act orders (g_idx)"
            )
        self.g_idx = g_idx
        return rows

    def finish_loading(self) -> None:
        """Act-order: sort the packed columns by group (each group then contiguous, as the kernel reads it)
        and keep the order, which the inputs take at run time."""
        if not self.g_idx.numel():
            return
        perm = torch.sort(self.g_idx, stable=True).indices
        if not torch.equal(
            self.g_idx[perm], torch.arange(self.in_features, device=perm.device) // self._group
        ):
            raise ValueError(f"g_idx does not give each group of {self._group} columns exactly its size")
        q = packing.unpack_int4(self.qweight.data)
        self.qweight.data = packing.pack_int4(q.index_select(1, perm)).contiguous()
        self.perm = perm

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in the checkpoint's column order."""
        w = packing.dequantize_int4(self.qweight, self.scales, self.zeros, dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or self.triton:
            try:
                from pagoda.kernels.quant_w4a16 import w4a16_linear
            except ImportError:
                pass
            else:
                if self.perm is not None:
                    x = x.index_select(1, self.perm)
                return w4a16_linear(x, self.qweight, self.scales, self.zeros, self._group, self.bias)
        return super()._matmul(x)


class Fp8Linear(_QuantizedLinear):
    """FP8 (e4m3) weights with a float32 scale per row (per-tensor scales expanded per fused part) or per
    (bn x bk) block; activations quantized per token at run time by the GPU kernel.

    Block-wise checkpoints quantize each projection on its own grid of blocks (from its own row 0). Where
    fused parts (q/k/v, gate/up) or a tensor-parallel slice cut the checkpoint's bn-row blocks (SmolLM2's
    k_proj starts at row 576 = 4.5 blocks), one grid over the fused rows cannot hold them, so the scales
    are held per row instead: ``block`` becomes (1, bk) and ``weight_scale`` [N, ceil(K / bk)], each row
    its part's block scales, which the kernel and its twins read like any other block size. Aligned
    checkpoints keep the compact [ceil(N / bn), ceil(K / bk)] grid."""

    kinds = ("weight", "weight_scale", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        group_size: int,
        block: tuple[int, int] | None,
    ):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.block = block  # what weight_scale holds: the checkpoint's blocks, or (1, bk) per row
        self.checkpoint_block = block
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device), False
        )
        if block is None:
            scale_shape: tuple[int, ...] = (out_features,)
        else:
            bn, bk = block
            scale_shape = (-(-out_features // bn), -(-in_features // bk))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device), False)
        # (rows, block rows) of the parts loaded on the checkpoint's grid, recounted if it turns per row
        self._grid_parts: list[tuple[int, int]] = []

    def load_part(self, kind: str, tensor: torch.Tensor, offset: int, rows: int, part: Part) -> int:
        """Copy a canonical tensor (or this rank's slice of it) into rows [offset, offset + rows) (block rows
        for a block-wise scale on the checkpoint's grid); a per-tensor scale fills its part's rows."""
        dest = self._param(kind)
        if kind == "weight_scale" and self.block is not None:
            return self._load_block_scale(tensor, offset, rows, part)
        if kind == "weight_scale" and tensor.numel() == 1:
            dest.narrow(0, offset, rows).fill_(float(tensor.reshape(())))
            return rows
        if part is not None:
            dim, indices = part
            if dim == 0 or kind == "weight":
                tensor = tensor.index_select(dim, torch.tensor(indices, dtype=torch.long))
        self._copy_rows(dest.narrow(0, offset, rows), tensor, kind)
        return rows

    def _load_block_scale(self, tensor: torch.Tensor, offset: int, rows: int, part: Part) -> int:
        """A part's [ceil(rows / bn), ceil(K / bk)] block scales, on the checkpoint's grid while every part
        lies on it, else per row. Returns what the loader counts against weight_scale's rows."""
        bn, bk = self.checkpoint_block
        row_indices = None
        if part is not None:
            dim, indices = part
            if dim == 0:
                row_indices = indices
            else:
                lo, hi = _span(indices, bk, "FP8 blocks")
                tensor = tensor[:, lo:hi]
        if self.block[0] > 1 and not self._on_grid(offset, rows, row_indices):
            self._hold_scales_per_row()
        if self.block[0] == 1:
            return self._load_row_scales(tensor, offset, rows, row_indices)
        if row_indices is not None:
            tensor = tensor.index_select(0, torch.tensor(row_indices[::bn], dtype=torch.long) // bn)
        block_rows = -(-rows // bn)
        self._copy_rows(self.weight_scale.narrow(0, offset // bn, block_rows), tensor, "weight_scale")
        self._grid_parts.append((rows, block_rows))
        return block_rows

    def _on_grid(self, offset: int, rows: int, row_indices: list[int] | None) -> bool:
        """Whether the part's blocks are whole blocks of the fused grid: it starts on a block boundary and
        fills its last block unless it ends the linear; a tensor-parallel slice takes whole blocks."""
        bn = self.checkpoint_block[0]
        if offset % bn or (rows % bn and offset + rows != self.out_features):
            return False
        if row_indices is None:
            return True
        lo = row_indices[0]
        return lo % bn == 0 and row_indices == list(range(lo, lo + len(row_indices)))

    def _hold_scales_per_row(self) -> None:
        """Switch weight_scale to one row of block scales per weight row: the rows loaded so far on the grid
        keep their blocks' scales (they started on a block boundary)."""
        bn, bk = self.checkpoint_block
        rows = self.weight_scale.data.repeat_interleave(bn, dim=0)[: self.out_features]
        self.weight_scale.data = rows.contiguous()
        self.block = (1, bk)

    def _load_row_scales(
        self, tensor: torch.Tensor, offset: int, rows: int, row_indices: list[int] | None
    ) -> int:
        bn = self.checkpoint_block[0]
        per_row = tensor.repeat_interleave(bn, dim=0)
        if row_indices is None:
            if tensor.shape[0] != -(-rows // bn):
                raise ValueError(
                    f"weight_scale has {tensor.shape[0]} block rows, expected {-(-rows // bn)} for {rows} rows"
                )
            per_row = per_row[:rows]
        elif row_indices[-1] >= per_row.shape[0]:
            raise ValueError(
                f"weight_scale has {tensor.shape[0]} block rows, too few for row {row_indices[-1]}"
            )
        else:
            per_row = per_row.index_select(0, torch.tensor(row_indices, dtype=torch.long))
        self._copy_rows(self.weight_scale.narrow(0, offset, rows), per_row, "weight_scale")
        # the loader counts rows written per parameter: parts counted in block rows are recounted in rows
        recount = sum(r - b for r, b in self._grid_parts)
        self._grid_parts.clear()
        return rows + recount

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return packing.dequantize_fp8(self.weight, self.weight_scale, self.block, dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or self.triton:
            try:
                from pagoda.kernels.quant_fp8 import fp8_linear
            except ImportError:
                pass
            else:
                return fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        return super()._matmul(x)
