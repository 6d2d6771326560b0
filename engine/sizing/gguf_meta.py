"""Read a GGUF file's metadata and tensor shapes, nothing else, in pure Python.

The `gguf` package's reader maps every element of every array (a 49k-token vocabulary becomes ~150k numpy
views) and takes seconds; sizing only needs a few integers and the tensor shapes, so it walks the header
with struct and skips array bodies. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.engine.sizing.errors import SizingError

_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
KEEP_ARRAY_ITEMS = 16  # arrays longer than this are returned as their length only
# ggml's tensor type ids (ggml.h's enum ggml_type) by name: sizing counts a tensor's bytes by its type
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16",
}  # fmt: skip


@dataclass
class GGUFMeta:
    version: int
    fields: dict[str, object]  # long arrays appear as ArrayLength
    tensors: dict[str, tuple[int, ...]]  # name -> shape
    tensor_types: dict[str, str] = field(default_factory=dict)  # name -> ggml type name ("Q4_1", "F32" ...)

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


@dataclass(frozen=True)
class ArrayLength:
    """A long array that was skipped; only its length is kept."""

    length: int


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise SizingError(f"{self.path}: GGUF header ends early (truncated file?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise SizingError(f"{self.path}: GGUF string runs past the end of the file")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if count <= KEEP_ARRAY_ITEMS:
                return [self.value(item) for _ in range(count)]
            if item in _SCALAR:
                self.pos += count * struct.calcsize(_SCALAR[item])
            elif item == _STRING:
                for _ in range(count):
                    n = self.unpack("<Q")  # read first: `pos += unpack()` would lose unpack's own advance
                    self.pos += n
            else:
                for _ in range(count):
                    self.value(item)
            if self.pos > len(self.buf):
                raise SizingError(f"{self.path}: GGUF array runs past the end of the file")
            return ArrayLength(count)
        raise SizingError(
            f"{self.path}: unknown GGUF value type {kind} (damaged file or a newer GGUF version)"
        )


def read_gguf_meta(path: str | Path) -> GGUFMeta:
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except SizingError:
        raise
    except (OSError, ValueError) as e:
        raise SizingError(f"{path}: cannot read GGUF file ({e})") from None


def _parse(buf, path: Path) -> GGUFMeta:
    c = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise SizingError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    c.pos = 4
    version = c.unpack("<I")
    if version not in (2, 3):
        raise SizingError(
            f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files aren't)"
        )
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.unpack("<I"))
    tensors: dict[str, tuple[int, ...]] = {}
    types: dict[str, str] = {}
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        kind = c.unpack("<I")
        c.unpack("<Q")  # data offset
        tensors[name] = dims
        types[name] = GGML_TYPE_NAMES.get(kind, f"type{kind}")
    return GGUFMeta(version, fields, tensors, types)
