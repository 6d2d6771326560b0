"""A linear whose weight stays in a GGUF file's quantized blocks, run by the CPU kernels of
kernels/cpu/quant_gguf.c (`--quantization gguf`).

The weight is one uint8 tensor [out_features, bytes per row]: row segments placed by `load_part` (q, k and v
of one layer, or gate and up, may come in different ggml types: Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0), each
row a run of its type's blocks; a segment narrower than the widest leaves the rest of its rows unused. The
forward runs one kernel call per run of rows of one type, each writing its columns of the output. The kernels
decode every weight to the float32 value the gguf package's dequantize gives and accumulate float32
activations against it, so the outputs are the dequantized model's up to summation order.

``PAGODA_GGUF_ACTIVATIONS=int8`` (engine/envs.py) switches decode's rows (up to INT8_ROWS_MAX) of Q4_0, Q4_1
and Q8_0 blocks to kernels/cpu/quant_gguf_q8act.c: the activations quantized to int8 per 32 values and
integer dot products (AVX512-VNNI, AVX2), as llama.cpp multiplies them; not exact, so off by default. The
K-quants and Q5_0, and prefill's rows, keep the exact product.
"""

from __future__ import annotations

import torch
from pagoda.engine import envs
from pagoda.kernels import gguf_reference
from pagoda.kernels.cpu import loader
from torch import nn

# ggml types the kernels run in their blocks (others are dequantized at load: engine/loader/gguf_quant.py)
KERNEL_TYPES = frozenset(gguf_reference.BLOCKS)
# ggml types the int8-activation product runs, and the most activation rows it takes (decode's)
INT8_TYPES = frozenset({gguf_reference.Q4_0, gguf_reference.Q4_1, gguf_reference.Q8_0})
INT8_ROWS_MAX = 8
ACTIVATION_MODES = ("float32", "int8")
_STATUS = {1: "a ggml type the kernels do not run", 2: "rows that are not whole blocks", 3: "out of memory"}


def gguf_matmul(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for W given as GGUF blocks (uint8 [N, >= row bytes], rows of ``ggml_type`` blocks)
    -> float32 [M, N] (into ``out``, which may be a column slice of a wider row-major tensor). float32 or
    bfloat16 ``x``; the native kernels must be loaded (RuntimeError naming why not)."""
    lib = loader.library()
    if lib is None:
        raise RuntimeError(
            f"--quantization gguf needs the native CPU kernels, which did not load: {loader.current().describe()}"
        )
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(m, n)
    status = lib.pagoda_gguf_linear(
        x.data_ptr(), m, k, x.stride(0), blocks.data_ptr(), n, blocks.stride(0), ggml_type,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        name = gguf_reference.NAMES.get(ggml_type, f"ggml type {ggml_type}")
        raise RuntimeError(f"GGUF product of {name} blocks [{n}, {k}] failed: {_STATUS.get(status, status)}")
    return out


def activation_mode() -> str:
    """``PAGODA_GGUF_ACTIVATIONS`` checked: "float32" (exact, the default) or "int8"."""
    mode = envs.gguf_activations()
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"PAGODA_GGUF_ACTIVATIONS={mode!r}: use one of {', '.join(ACTIVATION_MODES)}")
    return mode


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """The float32 weight [N, k] of GGUF blocks, decoded by the same kernels (the dequantized model's values)."""
    lib = loader.library()
    out = torch.empty(blocks.shape[0], k)
    if lib is None:
        return gguf_reference.dequantize_gguf(
            blocks[:, : gguf_reference.row_bytes(ggml_type, k)], ggml_type, k
        ).float()
    status = lib.pagoda_gguf_dequantize(
        blocks.data_ptr(), blocks.shape[0], k, blocks.stride(0), ggml_type, out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"GGUF decode of ggml type {ggml_type} failed: {_STATUS.get(status, status)}")
    return out


class GGUFLinear(nn.Module):
    """``y = x W^T (+ bias)`` over GGUF blocks. ``weight``: uint8 [out_features, bytes per row] (empty until
    the first part loads); ``segments``: (row offset, rows, ggml type) runs, merged where neighbours share a
    type."""

    kinds = ("weight", "bias")
    dense_on_cpu = False  # it is the CPU's quantized path

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        if torch.device(device).type != "cpu":
            raise ValueError("GGUF blocks run on the CPU only (--quantization gguf with --device cpu)")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = nn.Parameter(torch.empty(out_features, 0, dtype=torch.uint8), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        self.segments: list[tuple[int, int, int]] = []
        self._calls: list[tuple] | None = None  # the kernel calls of forward, made on first use
        self.lora = None  # pagoda.engine.lora.layers.LoRALinear when the engine serves LoRA adapters

    @torch.no_grad()
    def load_part(self, kind: str, tensor: torch.Tensor, offset: int, rows: int, part=None) -> int:
        """Place a checkpoint part at rows [offset, offset + rows): "weight" is uint8 blocks [rows, row bytes]
        carrying its ggml type as ``tensor.ggml_type`` (engine/loader/gguf_quant.py yields them so); "bias"
        a float vector. Returns the rows written. Tensor-parallel slices (``part``) are refused."""
        if part is not None:
            raise ValueError(
                "GGUF blocks are not sharded over tensor-parallel ranks: use --tensor-parallel-size 1"
            )
        if kind == "bias":
            if self.bias is None or tuple(tensor.shape) != (rows,):
                raise ValueError(
                    f"a bias of shape {tuple(tensor.shape)} has no place in rows {offset}+{rows}"
                )
            self.bias[offset : offset + rows].copy_(tensor)
            return rows
        if kind != "weight":
            raise KeyError(kind)
        ggml_type = getattr(tensor, "ggml_type", None)
        if ggml_type not in KERNEL_TYPES:
            raise ValueError(
                f"GGUFLinear takes blocks of {sorted(gguf_reference.NAMES.values())}, got {ggml_type}"
            )
        width = gguf_reference.row_bytes(ggml_type, self.in_features)
        if (
            tensor.dtype != torch.uint8
            or tuple(tensor.shape) != (rows, width)
            or offset + rows > self.out_features
        ):
            raise ValueError(
                f"{gguf_reference.NAMES[ggml_type]} blocks of shape {tuple(tensor.shape)} {tensor.dtype} do not fit "
                f"rows {offset}+{rows} of a [{self.out_features}, {self.in_features}] weight"
            )
        if width > self.weight.shape[1]:  # a wider type than so far: widen in place (the parameter stays)
            wider = torch.zeros(self.out_features, width, dtype=torch.uint8)
            wider[:, : self.weight.shape[1]] = self.weight
            self.weight.data = wider
        self.weight[offset : offset + rows, :width].copy_(tensor)
        self.segments = _merge([s for s in self.segments if s[0] != offset] + [(offset, rows, ggml_type)])
        self._calls = None
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        m = flat.shape[0]
        y = torch.empty(m, self.out_features)
        if m:
            calls = self._calls if self._calls is not None else self._prepare()
            xp, xs, yp, n_out, k = (
                flat.data_ptr(),
                flat.stride(0),
                y.data_ptr(),
                self.out_features,
                self.in_features,
            )
            threads = torch.get_num_threads()
            for exact, int8, w_ptr, rows, w_stride, ggml_type, offset in calls:
                fn = int8 if int8 is not None and m <= INT8_ROWS_MAX else exact
                status = fn(xp, m, k, xs, w_ptr, rows, w_stride, ggml_type, yp + 4 * offset, n_out, threads)
                if status != 0:
                    gguf_matmul(flat, self.weight[offset : offset + rows], ggml_type)  # raises, naming why
        if self.bias is not None:
            y += self.bias
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y

    def _prepare(self) -> list[tuple]:
        """Each segment's kernel calls (exact function, int8-activation function or None, weight address,
        rows, row stride, type, first column), made once: a decode step's linears are short calls, so the
        per-call Python is kept to one ctypes call. The activation mode is read here, at first use."""
        lib = loader.library()
        if lib is None:
            gguf_matmul(torch.zeros(1, self.in_features), self.weight, 0)  # raises: the kernels did not load
        w = self.weight
        int8 = activation_mode() == "int8"
        self._calls = [
            (
                lib.pagoda_gguf_linear,
                lib.pagoda_gguf_linear_q8 if int8 and ggml_type in INT8_TYPES else None,
                w.data_ptr() + offset * w.stride(0),
                rows,
                w.stride(0),
                ggml_type,
                offset,
            )
            for offset, rows, ggml_type in self.segments
        ]
        return self._calls

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as dense ``dtype`` [out_features, in_features] (tests, LoRA merges)."""
        w = torch.empty(self.out_features, self.in_features)
        for offset, rows, ggml_type in self.segments:
            w[offset : offset + rows] = gguf_dequantize(
                self.weight[offset : offset + rows], ggml_type, self.in_features
            )
        return w.to(dtype)

    def extra_repr(self) -> str:
        types = "+".join(gguf_reference.NAMES[t] for _, _, t in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={types or 'none'}"


def _merge(segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Sorted segments with touching neighbours of one type joined (one kernel call for a fused q/k/v)."""
    out: list[tuple[int, int, int]] = []
    for offset, rows, ggml_type in sorted(segments):
        if out and out[-1][2] == ggml_type and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + rows, ggml_type)
        else:
            out.append((offset, rows, ggml_type))
    return out
