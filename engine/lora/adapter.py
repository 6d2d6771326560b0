"""PEFT LoRA adapters from disk: `adapter_config.json` + `adapter_model.safetensors`, checked against the model.

Only safetensors is read (never a pickle: `adapter_model.bin` is refused with what to do instead). Targets are
the attention and MLP projections (q/k/v/o, gate/up/down) of the decoder layers; anything PEFT can add that
changes more than those products (DoRA, biases, modules_to_save, embedding or LM-head adapters) is refused
with its name, so a loaded adapter always computes what PEFT computes:

    y = x W^T + scale * (x A^T) B^T,  scale = lora_alpha / r  (lora_alpha / sqrt(r) with use_rslora)

with the rank and alpha of each module (`rank_pattern`, `alpha_pattern` honoured, their keys matched without
`re`: engine/lora/patterns.py). The scale is folded into B here, once. The adapter's fingerprint (SHA-256 of its weight file and the numbers that shape the product)
is what the prefix cache keys its KV by, so the same adapter under two names shares KV and a different one
under an old name never does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.engine.lora.patterns import PatternError, PatternTable

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 16 << 20  # EVA writes a pattern key per module: a few MiB for the largest models
# module -> (the decoder sub-module it lives in, the fused layer of ours that carries it)
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$"
)
_REFUSED_FLAGS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D base layers)",
}


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message says what and why."""


class UnreadableAdapterError(AdapterError):
    """A path that is not a readable PEFT adapter, said the same way whatever is or is not there (no such
    path, not a directory, a file missing, unreadable or not what its name says): whoever may load adapters
    learns nothing about the files the engine can see. ``detail`` says which, for the engine's log."""

    def __init__(self, path: object, detail: str) -> None:
        super().__init__(
            f"LoRA adapter path {str(path)!r} is not a readable PEFT adapter directory: it needs {CONFIG_FILE} "
            f"and {WEIGHTS_FILE} (weights saved with safe_serialization=True; pickled weights are never loaded)"
        )
        self.detail = detail


@dataclass(frozen=True)
class ModuleShape:
    """A target module's (in_features, out_features) in the base model."""

    in_features: int
    out_features: int


@dataclass
class AdapterWeights:
    """One adapter read from disk: per (layer, module) A [r, in] and B [out, r] with the scale folded into B,
    in float32 on the host."""

    path: str
    rank: int  # the largest rank of any module
    fingerprint: str  # hex; keys the adapter's KV (see the module docstring)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values()
        )


def read_adapter_config(path: Path, given: object = None) -> dict:
    """``given``: the path as the caller named it (what an unreadable path's message shows)."""
    given = path if given is None else given
    file = path / CONFIG_FILE
    try:
        if not file.is_file():  # a regular file (never a device or a FIFO)
            raise OSError("missing, or not a regular file")
        with file.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:
        raise UnreadableAdapterError(given, f"{file}: {exc}") from None
    if not isinstance(config, dict):
        raise UnreadableAdapterError(given, f"{file} does not hold a JSON object")
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type {peft_type} is not supported; only LORA adapters are")
    for key, what in _REFUSED_FLAGS.items():
        if config.get(key):
            raise AdapterError(f"{file}: {what} is not supported")
    if str(config.get("bias") or "none") != "none":
        raise AdapterError(f"{file}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{file}: modules_to_save ({', '.join(map(str, config['modules_to_save']))}) is not supported: "
            "such an adapter replaces whole layers of the base model"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"{file}: {key} must be a positive number, got {value!r}")
    return config


def load_adapter(
    path: str | Path, num_layers: int, shapes: dict[str, ModuleShape], max_rank: int
) -> AdapterWeights:
    """Read and check a PEFT LoRA directory (or `org/name[@revision]` in the local Hugging Face cache) for a model of ``num_layers`` layers whose target modules have
    ``shapes``; refuse a rank above ``max_rank`` (--max-lora-rank)."""
    from pagoda.engine.loader.resolve import ModelNotFoundError, locate_adapter

    given = path
    try:
        path = locate_adapter(path)
        if not path.is_dir():
            raise UnreadableAdapterError(
                given, f"{str(path)!r} is not a directory (nor a hub id in the local cache)"
            )
    except (ModelNotFoundError, OSError, ValueError) as exc:
        if isinstance(exc, UnreadableAdapterError):
            raise
        raise UnreadableAdapterError(given, str(exc)) from None
    config = read_adapter_config(path, given)
    # PEFT's rule: the first key that matches a dotted suffix of the module's full name (engine/lora/patterns.py)
    try:
        rank_pattern = PatternTable(config.get("rank_pattern") or {}, "rank_pattern")
        alpha_pattern = PatternTable(config.get("alpha_pattern") or {}, "alpha_pattern")
    except PatternError as exc:
        raise AdapterError(f"{path / CONFIG_FILE}: {exc}") from None
    weights_file = path / WEIGHTS_FILE
    try:
        if not weights_file.is_file():
            raise OSError("missing, or not a regular file")
        raw = weights_file.read_bytes()
    except OSError as exc:
        pickled = [name for name in PICKLED_FILES if (path / name).exists()]
        why = f"its weights are {pickled[0]} (a pickle, never loaded)" if pickled else str(exc)
        raise UnreadableAdapterError(given, f"{weights_file}: {why}") from None
    try:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(raw)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
        raise UnreadableAdapterError(
            given, f"{weights_file} is not a readable safetensors file: {exc}"
        ) from None

    default_rank, default_alpha = config["r"], config["lora_alpha"]
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(
                f"{weights_file}: tensor {name!r} is not a LoRA matrix of a decoder layer's projection; "
                f"adapters may target {', '.join(TARGET_MODULES)}"
            )
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if TARGET_MODULES.get(module) != parent:
            raise AdapterError(
                f"{weights_file}: {parent}.{module} is not a supported target; adapters may target "
                f"{', '.join(TARGET_MODULES)}"
            )
        if not 0 <= layer < num_layers:
            raise AdapterError(f"{weights_file}: layer {layer} does not exist (the model has {num_layers})")
        pairs.setdefault((layer, module), {})[which] = tensor

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, module), pair in sorted(pairs.items()):
        where = f"layers.{layer}.{TARGET_MODULES[module]}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: {where} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        shape = shapes[module]
        r = a.shape[0]
        want_a, want_b = (r, shape.in_features), (shape.out_features, r)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{weights_file}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"model needs [r, {shape.in_features}] and [{shape.out_features}, r]"
            )
        try:
            expected = rank_pattern.value(f"model.{where}", default_rank)
            alpha = alpha_pattern.value(f"model.{where}", default_alpha)
        except PatternError as exc:
            raise AdapterError(f"{path / CONFIG_FILE}: {exc}") from None
        if r != expected:
            raise AdapterError(f"{weights_file}: {where} has rank {r}, its config says {expected}")
        if r > max_rank:
            raise AdapterError(
                f"{str(path)!r} has rank {r} ({where}), above --max-lora-rank {max_rank}; start the engine "
                f"with --max-lora-rank {r} or more"
            )
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[(layer, module)] = (a.float().contiguous(), (b.float() * scale).contiguous())
        top_rank = max(top_rank, r)
    if not modules:
        raise AdapterError(f"{weights_file} holds no LoRA matrices")

    h = hashlib.sha256(b"pagoda-lora-v1\0")
    h.update(hashlib.sha256(raw).digest())
    numbers = {k: config.get(k) for k in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")}
    h.update(json.dumps(numbers, sort_keys=True, default=str).encode())
    return AdapterWeights(str(path), top_rank, h.hexdigest()[:32], modules)
