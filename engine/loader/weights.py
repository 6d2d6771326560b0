"""Safetensors weights: loading into our model (mmap, never pickle), sizing and fingerprinting."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from pagoda.engine.attention.base import AttentionBackend
from pagoda.engine.loader.content_hash import file_sha256
from pagoda.engine.models import ModelConfig, get_model_class
from pagoda.engine.quantization.convert import canonical_tensors


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def read_safetensors_header(file: Path) -> tuple[bytes, dict]:
    """The raw JSON header bytes and their parse; reads only the header, never the tensors."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{str(file)!r} is not a safetensors file (header of {n} bytes)")
        raw = f.read(n)
    return raw, json.loads(raw)


def weights_nbytes(path: str | Path) -> int:
    """Bytes of all parameters as stored on disk, from the headers only."""
    total = 0
    for file in safetensors_files(path):
        _, header = read_safetensors_header(file)
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                total += end - start
    return total


def model_fingerprint(path: str | Path) -> str:
    """Stable hex digest (same in every process) of config.json and each safetensors file's header, size and
    content SHA-256. Disk-tier KV is keyed by it and outlives rollouts, so retrained weights with the same
    shapes must not share it; the content hash costs one read per file version (see content_hash)."""
    path = Path(path)
    h = hashlib.sha256(b"pagoda-model-v2\0")
    h.update((path / "config.json").read_bytes())
    for file in safetensors_files(path):
        raw, _ = read_safetensors_header(file)
        h.update(f"\0{file.name}\0{file.stat().st_size}\0{file_sha256(file)}\0".encode())
        h.update(raw)
    return h.hexdigest()[:32]


def iter_weights(path: str | Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file, memory-mapped."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(path)
    total = sum(len([k for k in read_safetensors_header(f)[1] if k != "__metadata__"]) for f in files)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    progress: bool = True,
) -> tuple[torch.nn.Module, ModelConfig]:
    """Build our model for the directory's config and fill it from its safetensors files."""
    config = ModelConfig.from_dir(path)
    model = get_model_class(config.architecture)(config, backend, dtype=dtype, device=torch.device(device))
    weights = iter_weights(path, progress)
    if config.quantization is not None and config.quantization.format in ("fp8", "int4"):
        # GPTQ / AWQ / compressed-tensors / FP8 tensors in the canonical layouts the quantized linears hold
        weights = canonical_tensors(weights, config.quantization, dtype)
    model.load_weights(weights)
    return model.eval(), config
