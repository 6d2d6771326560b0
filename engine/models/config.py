"""The model's shape, read from a Hugging Face config.json (old `rope_scaling` and new `rope_parameters`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Hugging Face model_type / architectures -> our family name.
_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "smollm": "llama",
    "smollm2": "llama",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    architecture: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"linear"|..., ...}; None = default
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # tokens a query may see, itself included; None = full attention
    # Per-layer attention kind ("full_attention" | "sliding_attention"); None = every layer the same.
    layer_types: list[str] | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False
    torch_dtype: str | None = None  # checkpoint dtype name, e.g. "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = ""

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type") or ""
        arch = _FAMILIES.get(model_type)
        if arch is None:
            for name in d.get("architectures") or []:
                arch = _FAMILIES.get(name)
                if arch:
                    break
        if arch is None:
            raise ValueError(
                f"model_type {model_type!r} (architectures {d.get('architectures')}) is not supported; "
                f"Pagoda runs Llama-family decoders: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] < 1:
                raise ValueError(f"config.json field {key} must be a positive integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if heads % kv_heads:
            raise ValueError(
                f"config.json field num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
            )

        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict):
            rope.update(scaling)
        rope_theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type == "default":
            rope_scaling = None
        else:
            rope.pop("type", None)
            rope["rope_type"] = rope_type
            rope_scaling = rope
            if rope_type not in ("llama3", "linear"):
                raise ValueError(
                    f"config.json rope_scaling type {rope_type!r} is not supported (llama3, linear)"
                )

        sliding_window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if arch == "qwen2":
            # Qwen2 only slides when use_sliding_window is set, and then only from max_window_layers on.
            if not d.get("use_sliding_window", False):
                sliding_window = None
                layer_types = None
            elif layer_types is None and sliding_window:
                mwl = d.get("max_window_layers", d["num_hidden_layers"])
                layer_types = [
                    "sliding_attention" if i >= mwl else "full_attention"
                    for i in range(d["num_hidden_layers"])
                ]
        if not sliding_window or sliding_window <= 0:
            sliding_window = None
            layer_types = None
        if layer_types is not None and all(t == "sliding_attention" for t in layer_types):
            layer_types = None

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(d.get("attention_bias", arch == "qwen2"))
        dtype = d.get("torch_dtype") or d.get("dtype")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 4 * d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            torch_dtype=str(dtype) if dtype else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return cls.from_hf_config(json.loads(cfg.read_text()))

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of one layer (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv heads x head_dim x bytes per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
