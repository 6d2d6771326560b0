"""Byte quantities as Kubernetes writes them ("64Gi", "500M") and as people read them."""

from __future__ import annotations

import re

from pagoda.engine.sizing.errors import SizingError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SUFFIX = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": KiB, "Mi": MiB, "Gi": GiB, "Ti": TiB, "Pi": 1 << 50,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB,
}  # fmt: skip

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | int, field: str = "memory") -> int:
    """Parse "64Gi", "8G", "512MiB" or a plain byte count; a bad value names the field."""
    if isinstance(value, int):
        if value < 0:
            raise SizingError(f"{field} must not be negative, got {value}")
        return value
    m = _QUANTITY.match(str(value))
    if not m or m.group(2) not in _SUFFIX:
        raise SizingError(
            f"{field}: cannot read {value!r} as a byte quantity (examples: 64Gi, 8G, 512Mi, 1073741824)"
        )
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def gib_floor(n: int) -> int:
    """Whole GiB not above n, in bytes."""
    return (max(n, 0) // GiB) * GiB


def gib_ceil(n: int) -> int:
    """Whole GiB not below n, in bytes."""
    return -(-max(n, 0) // GiB) * GiB


def human_bytes(n: int | float) -> str:
    """Binary units, two decimals: 1.50 GiB."""
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
