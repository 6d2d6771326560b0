"""What each KV-cache dtype is, said once: bytes, scales, torch dtype, the GPUs that run it, the CPU kernels' code.

`--kv-cache-dtype` takes "auto" (the model's own dtype) or one of the quantized rows below. The runner
allocates the torch dtype named here, sizing counts its bytes, the planner and the operator refuse it where
the GPU lacks it (one rule, one message: check_kv_cache_dtype), the CRD's enum lists the flag's values, and
kernels/cpu's C code (its CT_* element codes, checked equal by tests/sizing/test_kv_dtypes.py) reads the rows
that have one. Pure Python: the operator imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.sizing.errors import SizingError, UnsupportedOnGPU

FP8_MIN_COMPUTE = (8, 9)  # Ada, Hopper, Blackwell have FP8 tensor cores; vLLM refuses FP8 KV on A100
BF16_MIN_COMPUTE = (8, 0)  # Ampere and newer have bfloat16 tensor cores; vLLM refuses bfloat16 on a T4

# kernels/cpu's cache element codes (CT_* in its C sources): the C side owns the numbers.
CT_F32, CT_I8, CT_BF16 = 0, 1, 2


@dataclass(frozen=True)
class KVCacheDtype:
    """One element type a KV cache may hold."""

    name: str  # a --kv-cache-dtype value, or the model dtype "auto" stands for
    torch_dtype: str  # torch's name of the element type (getattr(torch, torch_dtype))
    element_bytes: int
    scale_bytes: int = 0  # per token, KV head and K|V: INT8 keeps a float32 scale beside its values
    min_compute: tuple[int, int] | None = None  # least CUDA compute capability; None: every GPU
    c_code: int | None = None  # kernels/cpu's CT_* code of this element type; None: no CPU kernel reads it
    flag: bool = True  # a value of --kv-cache-dtype (False: reached only through "auto")

    @property
    def quantized(self) -> bool:
        """One byte per element (FP8, INT8): fewer bytes than any model dtype."""
        return self.element_bytes == 1


_ROWS = (
    KVCacheDtype("fp8", "float8_e4m3fn", 1, min_compute=FP8_MIN_COMPUTE),  # vLLM's name for e4m3
    KVCacheDtype("fp8_e4m3", "float8_e4m3fn", 1, min_compute=FP8_MIN_COMPUTE),
    KVCacheDtype("fp8_e5m2", "float8_e5m2", 1, min_compute=FP8_MIN_COMPUTE),
    KVCacheDtype("int8", "int8", 1, scale_bytes=4, c_code=CT_I8),
    # "auto": the model's dtype
    KVCacheDtype("float32", "float32", 4, c_code=CT_F32, flag=False),
    KVCacheDtype("float16", "float16", 2, flag=False),
    KVCacheDtype("bfloat16", "bfloat16", 2, min_compute=BF16_MIN_COMPUTE, c_code=CT_BF16, flag=False),
)
KV_DTYPE_TABLE: dict[str, KVCacheDtype] = {row.name: row for row in _ROWS}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *(row.name for row in _ROWS if row.flag))  # the flag's choices

# Other spellings of the model dtypes (`--dtype` values, torch names) -> the table's names.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
_BY_TORCH_NAME = {row.torch_dtype: row for row in reversed(_ROWS)}  # float8_e4m3fn -> fp8


def lookup(name: str) -> KVCacheDtype:
    """The row of a --kv-cache-dtype value, a model dtype (any `--dtype` spelling) or a torch dtype name."""
    key = str(name).lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    row = KV_DTYPE_TABLE.get(key) or _BY_TORCH_NAME.get(key)
    if row is None:
        raise SizingError(f"unknown dtype {name!r}; known: {', '.join(dtype_names())}")
    return row


def kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: str) -> KVCacheDtype:
    """What a cache of `--kv-cache-dtype kv_cache_dtype` holds for a model computing in `model_dtype`."""
    return lookup(model_dtype if kv_cache_dtype in (None, "auto") else kv_cache_dtype)


def kv_dtype_name(name: str | None, model_dtype: str) -> str:
    """The torch name of what the cache holds ("float8_e4m3fn", "int8", or the model's dtype)."""
    return kv_cache_dtype(name, model_dtype).torch_dtype


def dtype_names() -> list[str]:
    """Every name `lookup` knows."""
    return list(dict.fromkeys([*DTYPE_ALIASES, *KV_DTYPE_TABLE, *_BY_TORCH_NAME]))


def check_kv_cache_dtype(kv_cache_dtype: str, where: str, compute_capability: tuple[int, int] | None) -> None:
    """Refuse a KV-cache dtype that `where` cannot run, naming it and what to use instead (compute_capability
    None: no GPU, as the operator's CPU pods). The one FP8 rule: compute capability 8.9 or newer."""
    if kv_cache_dtype in (None, "auto"):
        return
    row = lookup(kv_cache_dtype)
    need = row.min_compute
    if not row.flag or need is None or (compute_capability is not None and tuple(compute_capability) >= need):
        return
    if compute_capability is not None:
        where = f"{where} (compute capability {compute_capability[0]}.{compute_capability[1]})"
    raise UnsupportedOnGPU(
        f"--kv-cache-dtype {kv_cache_dtype} needs FP8, which {where} does not have: FP8 KV caches need compute "
        f"capability {need[0]}.{need[1]} or newer (L4, L40S, H100, H200, B200). Use --kv-cache-dtype int8 "
        "(about half the KV bytes, with a scale per token and head) or auto (the model's dtype)"
    )
