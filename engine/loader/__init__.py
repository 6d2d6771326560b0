"""Finding, converting and loading models: HF directories, GGUF files and the embedded default."""

from __future__ import annotations

from pagoda.engine.loader.resolve import ModelNotFoundError, pagoda_cache_dir, resolve_model
from pagoda.engine.loader.tokenizer import load_tokenizer
from pagoda.engine.loader.weights import iter_weights, load_model, model_fingerprint, weights_nbytes

__all__ = [
    "ModelNotFoundError",
    "iter_weights",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "pagoda_cache_dir",
    "resolve_model",
    "weights_nbytes",
]
