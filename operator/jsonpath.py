"""The dotted subset of JSONPath that printer columns use (`.status.plan.max_model_len`, `.items[0].x`)."""

from __future__ import annotations

import re
from typing import Any

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def jsonpath_get(obj: Any, path: str) -> Any:
    """The value at `path`, or None where any step is missing."""
    for name, index in _PART.findall(path.strip().strip("{}").lstrip("$")):
        if name:
            obj = obj.get(name) if isinstance(obj, dict) else None
        else:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
        if obj is None:
            return None
    return obj
