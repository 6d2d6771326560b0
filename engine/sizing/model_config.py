"""The one reader of a Hugging Face config.json (old `rope_scaling` and new `rope_parameters`).

The engine builds its model from a ModelConfig, and the planner's shapes (shapes.shape_from_config) are read
through the same function, so both see the same heads, head_dim, dtype and sliding window. `strict` is the
engine's reading: the family must be in the architecture table and its RoPE scaling implemented, and a
multimodal wrapper is refused unless the table serves its language model (Gemma 3's, read from its
text_config). Sizing reads leniently (any Llama-shaped decoder, the decoder of any wrapper), since a shape is
sized before anyone knows the engine will run it.

Sliding window rule (one for both): a window applies where config.json sets `sliding_window` > 0, unless
`use_sliding_window` is false; a family whose table entry says "opt_in" (Qwen2) slides only with
`use_sliding_window: true`, and then from `max_window_layers` on. The planner's window is the engine's: a
window at least max_position_embeddings long is still the window the engine's kernels run with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.quantization.detect import UnsupportedQuantizationError, detect_quantization
from pagoda.engine.quantization.scheme import QuantScheme
from pagoda.engine.sizing import architectures
from pagoda.engine.sizing.errors import SizingError, UnsupportedModelError

DEFAULT_MAX_POSITIONS = 2048


@dataclass
class ModelConfig:
    architecture: str  # a name of the architecture table ("" when read leniently without a known family)
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
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
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
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    attn_logit_softcapping: float | None = None  # attention scores c*tanh(s/c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits c*tanh(x/c) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    rope_local_base_freq: float | None = None  # RoPE theta of the sliding layers (Gemma 3); None: rope_theta
    qk_norm: bool = False  # RMSNorm per head on q and k before rotary (the table's feature: Qwen3)
    partial_rotary_factor: float = 1.0  # rotary on this leading part of head_dim (Phi-4-mini: 0.75)
    embedding_multiplier: float = 1.0  # token embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each block's output times this before the residual add (Granite)
    attention_multiplier: float | None = None  # the attention scale itself (Granite); see attention_scale
    logits_scaling: float = 1.0  # final logits divided by this (Granite)
    # Mixture of experts (the table's `experts` feature: Qwen3-MoE, Mixtral); num_experts 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's intermediate size (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to one
    decoder_sparse_step: int = 1  # every Nth layer is sparse (Qwen3-MoE) ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these, which keep a dense MLP
    scoring_func: str = "softmax"  # router scores: softmax over the experts, or sigmoid (DeepSeek-V3 style)
    routed_scaling_factor: float = 1.0  # the chosen experts' weights times this
    # gpt-oss's clamped SwiGLU: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # config.json is a multimodal checkpoint (model_type the wrapper's, e.g. "gemma3") whose language model
    # alone is served: its text_config read, the vision tower's tensors skipped at load, images refused.
    multimodal_checkpoint: bool = False
    # A quantized checkpoint's scheme (config.json's quantization_config; engine/quantization); None = float.
    quantization: QuantScheme | None = None

    @property
    def family(self) -> architectures.Architecture:
        """The architecture table's entry (the generic decoder for a lenient read of an unknown family)."""
        return architectures.architecture(self.architecture) if self.architecture else architectures.GENERIC

    @classmethod
    def from_hf_config(
        cls, d: dict[str, Any], *, strict: bool = True, where: str = "config.json"
    ) -> ModelConfig:
        """Read a config.json dict; a SizingError (a ValueError) naming the field where it cannot be, an
        UnsupportedModelError where the model is one the engine does not run."""
        d = dequantized_at_load(d)
        model_type = d.get("model_type") or ""
        quantization = _refuse_quantized(d, where)  # a wrapper's is not in its text_config
        family = architectures.from_hf_config(d)
        multimodal = family is None and isinstance(d.get("text_config"), dict)
        if multimodal and (wrapper := architectures.multimodal_of(d)) is not None:
            d, family = _language_model_config(d, wrapper), wrapper  # served text only
        elif multimodal and strict:
            served = ", ".join(t for a in architectures.ARCHITECTURES for t in a.multimodal_model_types)
            raise UnsupportedModelError(
                f"{where}: model_type {model_type!r} ({', '.join(d.get('architectures') or [])}) is a multimodal "
                "checkpoint (its decoder under text_config), which Pagoda does not run; of multimodal "
                f"checkpoints it serves the language model (text only) of model_type {served}"
            )
        elif multimodal:  # sizing reads the decoder of any wrapper
            d = {**d, **d["text_config"]}
            family = architectures.from_hf_config(d)
        if family is None and strict:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {d.get('architectures')}) is not supported; "
                f"Pagoda runs these architectures: {', '.join(architectures.SUPPORTED_ARCHITECTURES)}"
            )
        if strict and d.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                f"{where}: use_bidirectional_attention (an embedding model) is not supported"
            )
        family = family or architectures.GENERIC
        layers = _positive(d, "num_hidden_layers", where)
        heads = _positive(d, "num_attention_heads", where)
        hidden = _positive(d, "hidden_size", where)
        vocab = _positive(d, "vocab_size", where)
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if strict and heads % kv_heads:
            raise SizingError(
                f"{where}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
            )
        max_positions = int(d.get("max_position_embeddings") or d.get("max_seq_len") or DEFAULT_MAX_POSITIONS)
        d, rope_local_base_freq = _per_layer_type_rope(d)
        rope_theta, rope_scaling = _rope(d, family, strict, where)
        sliding_window, layer_types = _sliding_window(d, family, layers)
        eos = d.get("eos_token_id")
        dtype = d.get("torch_dtype") or d.get("dtype")
        return cls(
            architecture=family.name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or 4 * hidden),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family.tied_embeddings_default)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=bool(d.get("attention_bias", family.qkv_bias)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            torch_dtype=str(dtype) if dtype else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            model_type=model_type,
            hidden_act=str(d.get("hidden_activation") or d.get("hidden_act") or "silu"),
            attn_logit_softcapping=_optional_float(d, "attn_logit_softcapping"),
            final_logit_softcapping=_optional_float(d, "final_logit_softcapping"),
            query_pre_attn_scalar=_optional_float(d, "query_pre_attn_scalar"),
            rope_local_base_freq=rope_local_base_freq,
            qk_norm=family.qk_norm,
            partial_rotary_factor=float(
                d.get("partial_rotary_factor")
                or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
                or 1.0
            ),
            embedding_multiplier=float(d.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(d.get("residual_multiplier") or 1.0),
            attention_multiplier=_optional_float(d, "attention_multiplier"),
            logits_scaling=float(d.get("logits_scaling") or 1.0),
            **_experts(d, family),
            multimodal_checkpoint=multimodal and bool(family.multimodal_model_types),
            quantization=quantization,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return cls.from_hf_config(json.loads(cfg.read_text()))

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether a layer's MLP is the mixture of experts (else the dense MLP of intermediate_size)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of one layer (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The factor of q.k: attention_multiplier where the config sets it (Granite), else
        query_pre_attn_scalar**-0.5 (Gemma), else head_dim**-0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.query_pre_attn_scalar:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of one layer: Gemma 3's sliding layers use rope_local_base_freq."""
        if self.rope_local_base_freq is not None and self.layer_sliding_window(layer) is not None:
            return self.rope_local_base_freq
        return self.rope_theta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The wrapper's own fields that hold for its language model too (the checkpoint's dtype, the chat's stop ids).
_WRAPPER_KEYS = ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings")


def _language_model_config(d: dict[str, Any], family: architectures.Architecture) -> dict[str, Any]:
    """The decoder's config of a multimodal checkpoint: its text_config over the family's text-config defaults
    (transformers fills what a published text_config omits, so must we), the wrapper's dtype, stop ids and
    tying over both."""
    merged = {**dict(family.text_config_defaults), **d["text_config"]}
    merged.update({k: d[k] for k in _WRAPPER_KEYS if d.get(k) is not None})
    merged["model_type"] = d.get("model_type")
    return merged


def _refuse_quantized(d: dict[str, Any], where: str) -> QuantScheme | None:
    """The scheme of a checkpoint stored quantized (config.json's quantization_config), for the engine and
    sizing alike; a format or scheme the engine does not run (bitsandbytes, 8-bit GPTQ, W8A8 int8 ...) is an
    UnsupportedModelError naming what runs (engine/quantization/detect.py)."""
    try:
        return detect_quantization(d, where)
    except UnsupportedQuantizationError as e:
        raise UnsupportedModelError(str(e)) from None


def _positive(d: dict[str, Any], key: str, where: str) -> int:
    value = d.get(key)
    if value is None:
        raise SizingError(f"{where}: missing {key!r}, which the engine and sizing need")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SizingError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_float(d: dict[str, Any], key: str) -> float | None:
    value = d.get(key)
    return None if value is None else float(value)


def _experts(d: dict[str, Any], family: architectures.Architecture) -> dict[str, Any]:
    """The mixture-of-experts fields of a family with experts (or of an unknown family read leniently):
    `num_experts` (Qwen3-MoE on the hub) or `num_local_experts` (Mixtral, and what transformers 5 writes);
    the top-k weights renormalised unless `norm_topk_prob` says otherwise (the table's default: Mixtral
    always renormalises, Qwen3-MoE only with norm_topk_prob)."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if not experts or not (family.experts or not family.name):
        return {}
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or 2),
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or d.get("intermediate_size") or 0),
        "norm_topk_prob": bool(d.get("norm_topk_prob", family.norm_topk_prob)),
        "decoder_sparse_step": int(d.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in d.get("mlp_only_layers") or []],
        "scoring_func": str(d.get("scoring_func") or "softmax"),
        "routed_scaling_factor": float(d.get("routed_scaling_factor") or 1.0),
        "swiglu_alpha": float(d.get("swiglu_alpha") or 1.702),
        "swiglu_limit": float(d.get("swiglu_limit") or 7.0),
    }


def dequantized_at_load(d: dict[str, Any]) -> dict[str, Any]:
    """config.json without a quantization_config the loader undoes itself: the MXFP4 experts of a family whose
    table entry lists the "mxfp4" weight format (gpt-oss), dequantized at load (engine/models/mxfp4.py), so the
    model runs, and is sized, as its float weights."""
    quant = d.get("quantization_config")
    family = architectures.from_hf_config(d)
    if (
        isinstance(quant, dict)
        and quant.get("quant_method") == "mxfp4"
        and family is not None
        and "mxfp4" in family.weight_formats
    ):
        return {k: v for k, v in d.items() if k != "quantization_config"}
    return d


def _per_layer_type_rope(d: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """(config with the full-attention layers' RoPE as its rope_parameters, the sliding layers' theta).

    transformers 5 writes Gemma 3's RoPE per layer kind ({"full_attention": {...}, "sliding_attention":
    {...}}); older configs set rope_theta, rope_scaling and rope_local_base_freq."""
    params = d.get("rope_parameters")
    local = _optional_float(d, "rope_local_base_freq")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_theta") is not None:
            local = float(sliding["rope_theta"])
        d = {**d, "rope_parameters": params["full_attention"]}
    return d, local


def _rope(
    d: dict[str, Any], family: architectures.Architecture, strict: bool, where: str
) -> tuple[float, dict[str, Any] | None]:
    rope = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling")
    if isinstance(scaling, dict):
        rope.update(scaling)
    rope_theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return rope_theta, None
    rope.pop("type", None)
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first configs named LongRoPE "su"
    rope["rope_type"] = rope_type
    if rope_type in ("longrope", "yarn", "llama3") and "original_max_position_embeddings" not in rope:
        # Phi-3 keeps the pretraining length beside rope_scaling; without one it is the model's length.
        original = d.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    if strict and rope_type not in family.rope_scalings:
        raise UnsupportedModelError(
            f"{where} rope_scaling type {rope_type!r} is not supported ({', '.join(family.rope_scalings)})"
        )
    return rope_theta, rope


def _sliding_window(
    d: dict[str, Any], family: architectures.Architecture, layers: int
) -> tuple[int | None, list[str] | None]:
    """(window, per-layer kinds) by the rule in the module's docstring."""
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is None and family.sliding_pattern:
        every = int(d.get("sliding_window_pattern") or family.sliding_pattern)
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    if family.sliding_window == "opt_in":
        if not d.get("use_sliding_window", False):
            return None, None
        if layer_types is None and window:
            first = d.get("max_window_layers", layers)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if d.get("use_sliding_window") is False or not window or int(window) <= 0:
        return None, None
    if layer_types is not None and all(t == "sliding_attention" for t in layer_types):
        layer_types = None
    return int(window), layer_types
