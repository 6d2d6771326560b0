"""Linear layers on the CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

`F.linear` on a CPU float32 weight goes to the BLAS sgemm, which repacks the weight on every call and, on
AMD CPUs, may not take its AVX-512 path; at the decode batch sizes of serving (8-256 rows) that left the
matmuls at a third of what the cores do. oneDNN with a weight packed once for the machine (the path that
torch's own CPU inference freezing takes) runs the same products at the cores' speed (measured:
docs/benchmarks.md).

Packing costs one more copy of each packed weight in host memory, kept beside the original (tensor-parallel
sharding, weight reloads and tests read the original). The pack follows the weight: a weight changed in
place (a reload) is packed again on its next use. Results differ from sgemm only in summation order (about
an ulp per product). Set ``PAGODA_ONEDNN_LINEAR=0`` to use `F.linear` everywhere.

Products of 1-64 rows (decode steps) may take the kernels library's small-rows product instead: it reads each
weight in its own layout, streaming it for a few rows and in L2-sized chunks fetched ahead for more, and on a
CPU with AVX512-BF16 multiplies bfloat16 activations and weights in place by its dot-product instructions.
Which of the two runs is measured on the host, per shape and row count, and kept in the kernel cache
(cpu_linear_choice.py; ``PAGODA_CPU_LINEAR=ours|onednn`` forces one).

bfloat16 products on an x86 CPU without bfloat16 multiply instructions (AVX512_BF16, AMX) compute in float32:
there oneDNN's bfloat16 kernels widen the operands themselves, several times slower than its float32 path over
a weight widened once (the packed copy is then float32: twice the bfloat16 weight). The products are the same
exact float32 products of bfloat16 values, rounded to bfloat16 at the output, as oneDNN's.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F
from pagoda.engine import envs
from pagoda.engine.models import cpu_linear_choice
from pagoda.engine.sizing.engine_plan import cpu_has_native_bf16
from pagoda.kernels.cpu import loader

_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocking from a typical row count; any row count works with the packed weight.
_ROWS_HINT = 64
SMALL_ROWS_MAX = 64  # kernels/cpu/small_rows.c


def enabled() -> bool:
    if not envs.onednn_linear():
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedWeight:
    """A weight's oneDNN copy (in the weight's dtype, or widened to float32 for float32 inputs), refreshed when
    the weight is replaced or changed in place."""

    __slots__ = ("_key", "_packed")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The packed copy of ``weight`` as ``dtype`` (default its own), or None where oneDNN does not apply
        (device, dtype, grad)."""
        dtype = dtype or weight.dtype
        if (
            weight.device.type != "cpu"
            or weight.dtype not in _DTYPES
            or dtype not in _DTYPES
            or weight.dim() != 2
        ):
            return None
        if torch.is_grad_enabled() and weight.requires_grad:
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, dtype)
        if key != self._key:
            self._packed = None
            self._key = None
            if not enabled():
                return None
            try:
                # a widened copy lives only until it is packed
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), _ROWS_HINT)
            except RuntimeError:
                return None
            self._key = key
        return self._packed


@functools.cache
def _no_bfloat16_multiply() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and not cpu_has_native_bf16()


def bfloat16_widens() -> bool:
    """Whether bfloat16 linears compute in float32 here: an x86 CPU without bfloat16 multiply instructions,
    with the oneDNN path on (``PAGODA_ONEDNN_LINEAR=0`` keeps `F.linear` as it is)."""
    return _no_bfloat16_multiply() and enabled()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the small-rows product where this host measured it faster, else
    the packed weight where it applies. A float32 ``x`` with a bfloat16 weight computes in float32 over the
    widened weight (exact products, float32 output); so does a bfloat16 ``x`` where `bfloat16_widens` (output
    rounded to bfloat16)."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and bfloat16_widens():
        return linear(x.float(), weight, bias, packed).to(torch.bfloat16)
    kind = _small_rows_kind(x, weight)
    if kind is not None:
        threads = torch.get_num_threads()
        if cpu_linear_choice.prefers_ours(
            kind, weight.shape, threads, x.shape[0], _ColdTimer, x.dtype, weight, packed
        ):
            y = _small_rows(x, weight, bias, kind)
            if y is not None:
                return y
    return onednn_linear(x, weight, bias, packed)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight
) -> torch.Tensor:
    """``F.linear`` through the packed weight where it applies (`linear` without the small-rows product)."""
    widen = x.dtype == torch.float32 and weight.dtype == torch.bfloat16
    if x.device.type == "cpu" and (x.dtype == weight.dtype or widen) and x.numel() > 0:
        w = packed.get(weight, x.dtype)
        if w is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, w, None if bias is None else bias.to(x.dtype), "none", [], ""
            )
    if widen:
        return F.linear(x, weight.float(), None if bias is None else bias.float())
    return F.linear(x, weight, bias)


def _small_rows_kind(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The small-rows product's operand kind for this product (cpu_linear_choice.Shape.kind), or None where it
    does not apply: 1-64 rows, CPU tensors with unit column strides, no autograd, dtypes it covers."""
    if x.dtype == torch.float32:
        kind = _F32_KINDS.get(weight.dtype)
    elif x.dtype == weight.dtype == torch.bfloat16:
        kind = "bf16"
    else:
        return None
    if (
        kind is None
        or x.dim() != 2
        or not 1 <= x.shape[0] <= SMALL_ROWS_MAX
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or x.shape[1] != weight.shape[1]
        or x.stride(1) != 1
        or weight.stride(1) != 1
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        or not envs.onednn_linear()
    ):
        return None
    kernels = loader.current()
    if kernels.lib is None or (kind == "bf16" and not kernels.bf16_dot):
        return None
    return kind


_F32_KINDS = {torch.float32: "f32", torch.bfloat16: "f32-bf16w"}


class _ColdTimer:
    """Times both products of a weight's shape as the engine meets them: its weights arriving from memory, not
    from a cache that the previous call warmed. Calls cycle through copies of the weight (each side its own)
    that together exceed the last-level cache twice, made on the first call and freed with the timer."""

    def __init__(self, dtype: torch.dtype, weight: torch.Tensor, packed: PackedWeight) -> None:
        self.dtype, self.weight, self.packed = dtype, weight, packed
        self.copies: list[tuple[torch.Tensor, PackedWeight]] = []

    def __call__(self, rows: int) -> dict[str, float]:
        """Seconds per call of both products of ``rows`` random rows of the dtype."""
        if not self.copies:
            n = cpu_linear_choice.cold_copies(self.weight.numel() * self.weight.element_size())
            self.copies = [(self.weight, self.packed)]
            with torch.inference_mode(False):  # the engine runs in inference mode; a pack reads _version
                self.copies += [(self.weight.clone(), PackedWeight()) for _ in range(n - 1)]
        x = torch.randn(rows, self.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(
            self.dtype
        )
        kind = _small_rows_kind(x, self.weight)
        turn = {cpu_linear_choice.OURS: 0, cpu_linear_choice.ONEDNN: 0}

        def ours() -> object:
            w, _ = self.copies[turn[cpu_linear_choice.OURS] % len(self.copies)]
            turn[cpu_linear_choice.OURS] += 1
            return _small_rows(x, w, None, kind)

        def onednn() -> object:
            w, pack = self.copies[turn[cpu_linear_choice.ONEDNN] % len(self.copies)]
            turn[cpu_linear_choice.ONEDNN] += 1
            return onednn_linear(x, w, None, pack)

        with torch.no_grad():
            for w, pack in self.copies:  # packs made before timing, not in the first timed calls
                onednn_linear(x, w, None, pack)
            return cpu_linear_choice.time_calls(
                {cpu_linear_choice.OURS: ours, cpu_linear_choice.ONEDNN: onednn}
            )


def small_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` for 1-`SMALL_ROWS_MAX` rows by the kernels library's small-rows product: float32
    ``x`` over a float32 or bfloat16 weight (float32 output), or bfloat16 ``x`` and weight by AVX512-BF16 dot
    products (bfloat16 output, rounded once from float32 sums, the bias added before); None where it does not
    apply (whether it should run instead of oneDNN is `linear`'s measured choice)."""
    kind = _small_rows_kind(x, weight)
    return None if kind is None else _small_rows(x, weight, bias, kind)


def _small_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str
) -> torch.Tensor | None:
    lib = loader.current().lib
    rows, k, n = x.shape[0], x.shape[1], weight.shape[0]
    threads = torch.get_num_threads()
    # a bfloat16 product with a bias sums in float32 and rounds once, after the bias
    y = torch.empty(rows, n, dtype=torch.float32 if bias is not None else x.dtype)
    if kind == "bf16":
        status = lib.pagoda_small_rows_bf16dp(
            x.data_ptr(), rows, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), y.data_ptr(), y.stride(0),
            int(y.dtype == torch.bfloat16), threads,
        )  # fmt: skip
    else:
        fn = lib.pagoda_small_rows_bf16w if kind == "f32-bf16w" else lib.pagoda_small_rows_f32
        status = fn(
            x.data_ptr(), rows, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), y.data_ptr(), y.stride(0),
            threads,
        )  # fmt: skip
    if status != 0:
        return None
    return y if bias is None else y.add_(bias).to(x.dtype)
