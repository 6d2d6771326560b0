"""The adapters an engine serves, by name: loaded from disk into host memory, unloaded on request.

A request names its adapter (the `model` of the OpenAI API); the engine core resolves the name here when it
admits the request, and the request then holds the adapter itself: unloading a name stops new requests,
while those already admitted finish with the weights they started with. Each load gets a new id, so a slot
never confuses an adapter with a later one loaded under the same name.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagoda.engine.kv_cache.hashing import BlockHash, adapter_chain_root
from pagoda.engine.lora.adapter import AdapterError, AdapterWeights, ModuleShape, load_adapter

log = logging.getLogger("pagoda.engine.lora")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(eq=False)
class LoRAAdapter:
    """One loaded adapter: its name, a process-unique id and its weights in host memory."""

    id: int
    name: str
    weights: AdapterWeights
    cache_root: BlockHash = field(init=False)  # where its requests' block-hash chains start

    def __post_init__(self) -> None:
        self.cache_root = adapter_chain_root(self.weights.fingerprint)

    @property
    def path(self) -> str:
        return self.weights.path

    @property
    def rank(self) -> int:
        return self.weights.rank

    def module_weights(self, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {module: pair for (i, module), pair in self.weights.modules.items() if i == layer}


class LoRARegistry:
    def __init__(
        self, num_layers: int, shapes: dict[str, ModuleShape], max_rank: int, reserved_names: tuple[str, ...]
    ) -> None:
        """``reserved_names``: names no adapter may take (the base model's served name)."""
        self.num_layers = num_layers
        self.shapes = shapes
        self.max_rank = max_rank
        self.reserved_names = reserved_names
        self._by_name: dict[str, LoRAAdapter] = {}
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
        weights = load_adapter(path, self.num_layers, self.shapes, self.max_rank)
        adapter = LoRAAdapter(next(self._ids), name, weights)
        self._by_name[name] = adapter
        log.info(
            "LoRA adapter %s loaded from %s (rank %d, %.1f MiB)",
            name,
            path,
            adapter.rank,
            weights.nbytes / 2**20,
        )
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Stop serving ``name``; KeyError when no adapter has it."""
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        log.info("LoRA adapter %s unloaded", name)
        return adapter
