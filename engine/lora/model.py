"""LoRA slots on a Llama-family model: the device side of serving adapters.

Attaches a `LoRALinear` to each fused projection (qkv, o, gate_up, down) of every decoder layer, keeps the
slot table, and turns a step's per-sequence adapters into slots (copying missing adapters in from host
memory) and per-row slots for the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from pagoda.engine.lora.adapter import ModuleShape
from pagoda.engine.lora.layers import LoRABatch, LoRAContext, LoRALinear, Slice
from pagoda.engine.lora.registry import LoRAAdapter
from pagoda.engine.lora.slots import SlotTable


def module_shapes(model: torch.nn.Module) -> dict[str, ModuleShape]:
    """(in, out) of every target module, from the model's first layer (all layers are alike)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden, q, kv, inter = model.config.hidden_size, attn.q_size, attn.kv_size, mlp.intermediate
    return {
        "q_proj": ModuleShape(hidden, q),
        "k_proj": ModuleShape(hidden, kv),
        "v_proj": ModuleShape(hidden, kv),
        "o_proj": ModuleShape(q, hidden),
        "gate_proj": ModuleShape(hidden, inter),
        "up_proj": ModuleShape(hidden, inter),
        "down_proj": ModuleShape(inter, hidden),
    }


class LoRAModel:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        if any(not hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
            raise ValueError(
                f"LoRA adapters are not supported on mixture-of-experts models ({model.config.architecture}): "
                "serve the model without --enable-lora"
            )
        self.model = model
        self.max_rank = max_rank
        self.context = LoRAContext()
        self.slots = SlotTable(max_loras)
        self.shapes = module_shapes(model)
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        self.layers: list[list[LoRALinear]] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
            fused = [
                (attn.qkv_proj, [Slice("q_proj", 0, q), Slice("k_proj", q, kv), Slice("v_proj", q + kv, kv)]),
                (attn.o_proj, [Slice("o_proj", 0, self.shapes["o_proj"].out_features)]),
                (mlp.gate_up_proj, [Slice("gate_proj", 0, inter), Slice("up_proj", inter, inter)]),
                (mlp.down_proj, [Slice("down_proj", 0, self.shapes["down_proj"].out_features)]),
            ]
            lora_layers = []
            for linear, slices in fused:
                lora = LoRALinear(
                    linear.weight.shape[1], slices, max_loras, max_rank, self.context, dtype, device
                )
                linear.lora = lora
                lora_layers.append(lora)
            self.layers.append(lora_layers)

    @property
    def device_bytes(self) -> int:
        """Memory the slots take on the device."""
        total = 0
        for layer in self.layers:
            for lora in layer:
                total += lora.a.numel() * lora.a.element_size()
                total += sum(b.numel() * b.element_size() for b in lora.b)
        return total

    def slots_for(self, adapters: Sequence[LoRAAdapter | None]) -> np.ndarray:
        """Each sequence's slot (-1 for the base model), loading the adapters not yet in a slot."""
        by_id = {a.id: a for a in adapters if a is not None}
        slot_of, loads = self.slots.assign(by_id)
        for slot, adapter_id in loads:
            self._load(slot, by_id[adapter_id])
        return np.asarray([-1 if a is None else slot_of[a.id] for a in adapters], dtype=np.int64)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for i, lora_layers in enumerate(self.layers):
            weights = adapter.module_weights(i)
            for lora in lora_layers:
                lora.set_slot(slot, weights)

    def release(self, adapter: LoRAAdapter) -> None:
        """An unloaded adapter's slot goes back to the free list."""
        self.slots.release(adapter.id)

    def set_batch(self, row_slots: np.ndarray | None) -> None:
        """The forward about to run: each row's slot (grouped by slot, base rows last), or None."""
        device = self.layers[0][0].a.device
        self.context.batch = (
            None if row_slots is None else LoRABatch.from_rows(row_slots, self.slots.num_slots, device)
        )
