"""Where a GGUF file's conversion lives in the Pagoda cache: torch-free, so the router finds the directory
the engine converted (and only the current converter's) without importing the converter."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pagoda.engine.loader.content_hash import file_sha256

CONVERTER_VERSION = 4  # 3: Qwen3, Gemma 2/3, Phi-3, Granite, generation_config.json; 4: windows, 27B scale


def gguf_cache_key(path: Path) -> str:
    """Short digest of the file's whole content and the converter version: stable across copies and
    reinstalls, and new for a retrained file of the same size (the content hash is computed once, see
    content_hash)."""
    content = file_sha256(path)
    return hashlib.sha256(f"pagoda-gguf-v{CONVERTER_VERSION}:{content}".encode()).hexdigest()[:12]


def converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"
