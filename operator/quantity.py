"""Kubernetes resource quantities (`200Gi`, `1.5G`, `512Mi`) as integers of bytes, both ways."""

from __future__ import annotations

import re

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([KMGTPE]i|[kMGTPE]?)\s*$")


def parse_quantity(value: str | int | float) -> int:
    """Bytes in a Quantity; raises ValueError with the bad text so callers can name the field."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} is negative")
        return int(value)
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a quantity (examples: 200Gi, 500G, 1073741824)")
    number, suffix = match.groups()
    scale = _BINARY.get(suffix) or _DECIMAL[suffix]
    return int(float(number) * scale)


def format_quantity(num_bytes: int) -> str:
    """The shortest exact binary Quantity, rounded up to whole MiB so a PVC is never smaller than asked."""
    if num_bytes <= 0:
        return "0"
    mib = -(-num_bytes // 2**20)
    for suffix, scale in (("Ti", 2**20), ("Gi", 2**10)):
        if mib % scale == 0:
            return f"{mib // scale}{suffix}"
    return f"{mib}Mi"
