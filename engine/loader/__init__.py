"""Finding, converting and loading models: HF directories, GGUF files and the embedded default.

Importing this package is torch-free (`pagoda serve --dry-run` and the operator locate models through
pagoda.engine.loader.resolve); the torch-backed names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.engine.loader.resolve import ModelNotFoundError, resolve_model

__all__ = [
    "ModelNotFoundError",
    "iter_weights",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "resolve_model",
    "weights_nbytes",
]

_LAZY = {
    "load_tokenizer": "pagoda.engine.loader.tokenizer",
    "iter_weights": "pagoda.engine.loader.weights",
    "load_model": "pagoda.engine.loader.weights",
    "model_fingerprint": "pagoda.engine.loader.weights",
    "weights_nbytes": "pagoda.engine.loader.weights",
}

if TYPE_CHECKING:  # pragma: no cover
    from pagoda.engine.loader.tokenizer import load_tokenizer
    from pagoda.engine.loader.weights import iter_weights, load_model, model_fingerprint, weights_nbytes


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagoda.engine.loader' has no attribute {name!r}")
