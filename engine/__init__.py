"""Pagoda's paged-attention inference engine.

Importing this package is cheap and torch-free (the sizing rules live here and the operator imports them);
the torch-backed names load on first use.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]

_LAZY = {
    "LLM": "pagoda.engine.frontend.llm",
    "SamplingParams": "pagoda.engine.sampling_params",
    "RequestOutput": "pagoda.engine.outputs",
    "CompletionOutput": "pagoda.engine.outputs",
    "EngineConfig": "pagoda.engine.config",
}

if TYPE_CHECKING:  # pragma: no cover
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.outputs import CompletionOutput, RequestOutput
    from pagoda.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagoda.engine' has no attribute {name!r}")
