"""The adapters an engine serves, by name: loaded from disk into host memory, unloaded on request.

A request names its adapter (the `model` of the OpenAI API); the engine core resolves the name here when it
admits the request, and the request then holds the adapter itself: unloading a name stops new requests,
while those already admitted finish with the weights they started with. Each load gets a new id, so a slot
never confuses an adapter with a later one loaded under the same name.

At most ``max_adapters`` names are served at once (--max-cpu-loras); a load past it is refused before
anything is read. Adapters of the same content (the same weights and scale: the same fingerprint) share one
copy of the weights in host memory, however many names they are loaded under. A path that is not a readable
adapter gets one message whatever is or is not there (adapter.UnreadableAdapterError); the log says which.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagoda.engine.kv_cache.hashing import BlockHash, adapter_chain_root
from pagoda.engine.lora.adapter import (
    AdapterError,
    AdapterWeights,
    ModuleShape,
    UnreadableAdapterError,
    load_adapter,
)

log = logging.getLogger("pagoda.engine.lora")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(eq=False)
class LoRAAdapter:
    """One loaded adapter: its name, a process-unique id and its weights in host memory."""

    id: int
    name: str
    weights: AdapterWeights  # shared by every adapter of the same content
    source: str = ""  # the path it was loaded from ("": the weights' own)
    cache_root: BlockHash = field(init=False)  # where its requests' block-hash chains start

    def __post_init__(self) -> None:
        self.cache_root = adapter_chain_root(self.weights.fingerprint)

    @property
    def path(self) -> str:
        return self.source or self.weights.path

    @property
    def rank(self) -> int:
        return self.weights.rank

    def module_weights(self, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {module: pair for (i, module), pair in self.weights.modules.items() if i == layer}


class LoRARegistry:
    def __init__(
        self,
        num_layers: int,
        shapes: dict[str, ModuleShape],
        max_rank: int,
        reserved_names: tuple[str, ...],
        max_adapters: int | None = None,
    ) -> None:
        """``reserved_names``: names no adapter may take (the base model's served name); ``max_adapters``:
        most names served at once (--max-cpu-loras; None: no limit)."""
        self.num_layers = num_layers
        self.shapes = shapes
        self.max_rank = max_rank
        self.reserved_names = reserved_names
        self.max_adapters = max_adapters
        self._by_name: dict[str, LoRAAdapter] = {}
        self._weights: dict[str, AdapterWeights] = {}  # fingerprint -> the one stored copy of that content
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str) -> LoRAAdapter | None:
        return self._by_name.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        return list(self._by_name.values())

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read the PEFT directory at ``path`` and serve it as ``name``; AdapterError (a ValueError) when the
        name is taken or the directory is not an adapter this engine can serve."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise AdapterError(
                f"LoRA adapter name {name!r} must be 1-128 letters, digits or ._:/@+- (starting with a letter or "
                "digit)"
            )
        if name in self.reserved_names:
            raise AdapterError(f"LoRA adapter name {name!r} is the base model's name")
        if name in self._by_name:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        if self.max_adapters is not None and len(self._by_name) >= self.max_adapters:
            raise AdapterError(
                f"{len(self._by_name)} LoRA adapters are loaded, as many as --max-cpu-loras "
                f"({self.max_adapters}) allows: unload one first, or start the engine with a larger "
                "--max-cpu-loras"
            )
        try:
            weights = load_adapter(path, self.num_layers, self.shapes, self.max_rank)
        except UnreadableAdapterError as exc:
            log.warning("LoRA adapter %s not loaded: %s", name, exc.detail)
            raise
        shared = self._weights.setdefault(weights.fingerprint, weights)
        adapter = LoRAAdapter(next(self._ids), name, shared, source=weights.path)
        self._by_name[name] = adapter
        log.info(
            "LoRA adapter %s loaded from %s (rank %d, %.1f MiB%s)",
            name,
            path,
            adapter.rank,
            weights.nbytes / 2**20,
            ", shared with an adapter of the same content" if shared is not weights else "",
        )
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Stop serving ``name``; KeyError when no adapter has it."""
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        fingerprint = adapter.weights.fingerprint
        if not any(a.weights.fingerprint == fingerprint for a in self._by_name.values()):
            del self._weights[
                fingerprint
            ]  # admitted requests keep their adapter (and its weights) to the end
        log.info("LoRA adapter %s unloaded", name)
        return adapter
