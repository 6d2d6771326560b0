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

    __slots__ = ("_key", "_packed", "routes")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None
        self.routes: dict[tuple, tuple | None] = {}  # `step_linear`'s decisions for this weight

    def get(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The packed copy of ``weight`` as ``dtype`` (default its own), or None where oneDNN does not apply
        (device, dtype, grad)."""
        dtype = dtype or weight.dtype
        key = (weight.data_ptr(), weight._version, weight.shape, weight.is_cpu, weight.dtype, dtype)
        if key == self._key and not (torch.is_grad_enabled() and weight.requires_grad):
            return self._packed  # (a key is kept only for a weight that passed the checks below)
        if (
            weight.device.type != "cpu"
            or weight.dtype not in _DTYPES
            or dtype not in _DTYPES
            or weight.dim() != 2
        ):
            return None
        if torch.is_grad_enabled() and weight.requires_grad:
            return None
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


class Settings:
    """The environment's switches for CPU linears, read once per step (`refresh`) rather than per linear: an
    environment lookup costs about a microsecond, and a decode step runs over a hundred linears."""

    __slots__ = ("values", "onednn", "widens")

    def __init__(self, values: tuple[bool, str]) -> None:
        self.values = values  # (PAGODA_ONEDNN_LINEAR, PAGODA_CPU_LINEAR) as read
        self.onednn = values[0] and torch.backends.mkldnn.is_available() and _has_linear_pointwise()
        self.widens = self.onednn and _no_bfloat16_multiply()


@functools.cache
def _has_linear_pointwise() -> bool:
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


_settings: Settings | None = None


def refresh() -> Settings:
    """Read the environment's switches again (the model's forward and `compute_logits` call it once per step,
    `linear` on every call; a test that sets a variable and calls a `Linear` module itself calls it). The
    object stays the same while the values do, so the linears' remembered routes stay valid."""
    global _settings
    values = (envs.onednn_linear(), envs.cpu_linear())
    if _settings is None or _settings.values != values:
        _settings = Settings(values)
    return _settings


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the small-rows product where this host measured it faster, else
    the packed weight where it applies. A float32 ``x`` with a bfloat16 weight computes in float32 over the
    widened weight (exact products, float32 output); so does a bfloat16 ``x`` where `bfloat16_widens` (output
    rounded to bfloat16). Reads the environment's switches (`refresh`) first; `step_linear` does not."""
    refresh()
    return step_linear(x, weight, bias, packed)


# routes of a product, decided once per (operands' layout, rows, threads, settings, library) and kept on its
# PackedWeight: the small-rows product, oneDNN's packed weight, or the same over x widened to float32
_SMALL, _ONEDNN, _WIDEN = 0, 1, 2
_MAX_ROUTES = 512
_SLOW = None  # 3-D x, autograd, or an empty x: the general path (`_linear`) every call


def step_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight
) -> torch.Tensor:
    """`linear` with the environment's switches as last read (`refresh`), and the route of the product
    remembered on ``packed`` per layout, row count, thread count and library: a decode step's linear is a
    look-up and one kernel call (the same route, so the same values, as deciding it again)."""
    settings = _settings or refresh()
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return _linear(x, weight, bias, packed, settings)
    threads = torch.get_num_threads()
    xs, ws, strides = x.shape, weight.shape, x.stride()
    rows = xs[0] if len(xs) == 2 else 0
    key = (
        x.dtype, xs[-1], strides[-1], x.is_cpu, rows if rows <= SMALL_ROWS_MAX else -1, threads,
        weight.data_ptr(), ws, weight.stride(), weight.dtype, weight.is_cpu,
        settings, loader.current().lib, cpu_linear_choice.generation,
    )  # fmt: skip
    route = packed.routes.get(key, packed)
    if route is packed:
        if len(packed.routes) >= _MAX_ROUTES:  # a PackedWeight passed many weights (tests, benchmarks)
            packed.routes.clear()
        route = packed.routes[key] = _route(x, weight, packed, settings, threads) if rows else _SLOW
    if route is _SLOW:
        return _linear(x, weight, bias, packed, settings)
    how = route[0]
    if how == _WIDEN:
        return step_linear(x.float(), weight, bias, packed).to(torch.bfloat16)
    if how == _SMALL:
        _, fn, k, n, w_stride, bf16dp, out_dtype = route
        # a bfloat16 product with a bias sums in float32 and rounds once, after the bias
        y = torch.empty(rows, n, dtype=torch.float32 if bias is not None else out_dtype)
        if bf16dp:
            status = fn(x.data_ptr(), rows, k, strides[0], weight.data_ptr(), n, w_stride, y.data_ptr(), n,
                        int(bias is None and out_dtype is torch.bfloat16), threads)  # fmt: skip
        else:
            status = fn(x.data_ptr(), rows, k, strides[0], weight.data_ptr(), n, w_stride, y.data_ptr(), n,
                        threads)  # fmt: skip
        if status == 0:
            return y if bias is None else y.add_(bias).to(out_dtype)
    return onednn_linear(x, weight, bias, packed)


def _route(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight, settings: Settings, threads: int
) -> tuple | None:
    """How `step_linear` runs a product of this layout (`_linear`'s decisions, made once)."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.is_cpu and settings.widens:
        return (_WIDEN,)
    kind = _small_rows_kind(x, weight, settings)
    if kind is not None and cpu_linear_choice.prefers_ours(
        kind, weight.shape, threads, x.shape[0], _ColdTimer, x.dtype, weight, packed
    ):
        lib = loader.current().lib
        fn = {"bf16": lib.pagoda_small_rows_bf16dp, "f32-bf16w": lib.pagoda_small_rows_bf16w}.get(
            kind, lib.pagoda_small_rows_f32
        )
        return (_SMALL, fn, x.shape[1], weight.shape[0], weight.stride(0), kind == "bf16", x.dtype)
    return (_ONEDNN,)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight, settings: Settings
) -> torch.Tensor:
    """`linear` deciding its route on this call (autograd, 3-D inputs and the routes' first calls)."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and settings.widens:
        return _linear(x.float(), weight, bias, packed, settings).to(torch.bfloat16)
    kind = _small_rows_kind(x, weight, settings)
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


def _small_rows_kind(x: torch.Tensor, weight: torch.Tensor, settings: Settings | None = None) -> str | None:
    """The small-rows product's operand kind for this product (cpu_linear_choice.Shape.kind), or None where it
    does not apply: 1-64 rows, CPU tensors with unit column strides, no autograd, dtypes it covers
    (``settings``: the switches to read, default the environment's now)."""
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
        or not (settings or refresh()).values[0]
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
