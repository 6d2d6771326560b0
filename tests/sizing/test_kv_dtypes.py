"""The KV-cache dtype table: the flag's values, bytes, the one FP8 rule, and the C kernels' codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pagoda.engine.config import KV_CACHE_DTYPES as CONFIG_CHOICES
from pagoda.engine.sizing.errors import SizingError, UnsupportedOnGPU
from pagoda.engine.sizing.kv_dtypes import (
    KV_CACHE_DTYPES,
    KV_DTYPE_TABLE,
    check_kv_cache_dtype,
    kv_cache_dtype,
    lookup,
)

CPU_KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
# The C element codes' names (CT_<name>) -> the table's rows.
C_NAMES = {"F32": "float32", "I8": "int8", "BF16": "bfloat16"}


def c_codes() -> dict[str, int]:
    """Every `#define CT_<NAME> <n>` of kernels/cpu's C sources (the C side owns these numbers)."""
    found: dict[str, int] = {}
    for path in sorted([*CPU_KERNELS.glob("*.h"), *CPU_KERNELS.glob("*.c")]):
        for name, value in re.findall(r"^\s*#define\s+CT_(\w+)\s+(\d+)", path.read_text(), re.MULTILINE):
            assert found.setdefault(name, int(value)) == int(value), f"CT_{name} defined twice, differently"
    return found


def test_the_table_codes_are_the_c_kernels_codes() -> None:
    codes = c_codes()
    assert codes, f"no CT_* element codes found in {CPU_KERNELS}"
    assert set(codes) == set(C_NAMES), "a C element code without a KV dtype row (or the reverse)"
    for name, value in codes.items():
        assert KV_DTYPE_TABLE[C_NAMES[name]].c_code == value, name
    with_code = {row.name for row in KV_DTYPE_TABLE.values() if row.c_code is not None}
    assert with_code == set(C_NAMES.values())


def test_the_flag_values_are_what_they_were() -> None:
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8") == CONFIG_CHOICES


@pytest.mark.parametrize(
    "flag, model, torch_name, element, scale",
    [
        ("auto", "bfloat16", "bfloat16", 2, 0),
        ("auto", "fp32", "float32", 4, 0),
        ("fp8", "bfloat16", "float8_e4m3fn", 1, 0),
        ("fp8_e5m2", "float16", "float8_e5m2", 1, 0),
        ("int8", "float32", "int8", 1, 4),
    ],
)
def test_what_a_cache_holds(flag: str, model: str, torch_name: str, element: int, scale: int) -> None:
    row = kv_cache_dtype(flag, model)
    assert (row.torch_dtype, row.element_bytes, row.scale_bytes) == (torch_name, element, scale)


def test_lookup_takes_every_spelling_and_names_the_known_ones() -> None:
    assert lookup("torch.float8_e4m3fn").name == "fp8" and lookup("half").name == "float16"
    with pytest.raises(SizingError, match="unknown dtype 'fp4'.*bfloat16"):
        lookup("fp4")


def test_the_one_fp8_rule() -> None:
    for kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        check_kv_cache_dtype(kv, "L4", (8, 9))
        with pytest.raises(
            UnsupportedOnGPU, match=r"A100 \(compute capability 8\.0\) does not have.*int8.*auto"
        ):
            check_kv_cache_dtype(kv, "A100", (8, 0))
        with pytest.raises(UnsupportedOnGPU, match="CPU pods does not have"):
            check_kv_cache_dtype(kv, "CPU pods", None)
    for kv in ("auto", "int8"):
        check_kv_cache_dtype(kv, "T4", (7, 5))
        check_kv_cache_dtype(kv, "CPU pods", None)
