"""LoRA adapters: many fine-tunes of one base model served together (docs/lora.md)."""

from pagoda.engine.lora.adapter import AdapterError, AdapterWeights, ModuleShape, load_adapter
from pagoda.engine.lora.registry import LoRAAdapter, LoRARegistry

__all__ = ["AdapterError", "AdapterWeights", "LoRAAdapter", "LoRARegistry", "ModuleShape", "load_adapter"]
