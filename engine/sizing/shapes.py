"""Model shapes: what sizing needs to know about a model, read without loading any weights.

A shape comes from a Hugging Face config.json (+ safetensors headers for the exact parameter bytes), from
GGUF metadata, or from a small table of well-known public models so plans work before weights exist.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pagoda.engine.quantization.scheme import QuantScheme
from pagoda.engine.sizing import architectures
from pagoda.engine.sizing.engine_plan import kv_bytes_per_token
from pagoda.engine.sizing.errors import SizingError, UnsupportedModelError
from pagoda.engine.sizing.kv_dtypes import kv_cache_dtype, lookup
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.weight_format import (
    Linear,
    WeightFormat,
    decoder_linears,
    gguf_format,
    scheme_format,
)

_SAFETENSORS_DTYPE = {"F64": "float32", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a model or KV dtype (any spelling the KV dtype table knows)."""
    return lookup(dtype).element_bytes


def kv_scale_bytes(kv_dtype: str | None) -> int:
    """Scale bytes per token, KV head and K|V that a KV dtype adds to its elements (INT8: 4, else 0)."""
    return 0 if kv_dtype in (None, "auto") else lookup(kv_dtype).scale_bytes


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide a model's memory: weights and KV bytes per token."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's compute dtype (GGUF: the dtype it is dequantised to)
    weight_bytes: int = 0  # parameter bytes in `dtype`
    num_params: int = 0
    tie_word_embeddings: bool = False
    # Attention scores soft-capped to c*tanh(s/c) (Gemma 2); the kernels compile a variant for it.
    attn_logit_softcapping: float | None = None
    # How many layers slide when sliding_window is set (Gemma: 1 in 2 or 5 in 6); None = every layer.
    sliding_window_layers: int | None = None
    architecture: str = ""  # the architecture table's family ("" = a Llama-shaped decoder of no known family)
    # Mixture of experts: num_params (memory) counts every expert of the sparse layers; active_params (speed)
    # only the experts_per_token a token runs through.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: int = 0
    # A quantized checkpoint (weight_format.py): its format ("fp8" | "int4" | "gguf"; "" = float weights), the
    # format in words, and the weight elements and bytes (scales and zero points included) of the linears it
    # holds quantized. num_params counts every parameter; the rest of them are held in `dtype`.
    weight_format: str = ""
    weight_format_label: str = ""
    quantized_params: int = 0
    quantized_bytes: int = 0
    quantized_extra_bytes: int = 0  # held quantized beside the float parameters (a GGUF's tied LM head)

    @property
    def quantized_by_default(self) -> bool:
        """Whether weight_bytes counts the quantized linears in their own bytes: FP8 and INT4 checkpoints
        (held so on a GPU); a GGUF file's blocks only with `--quantization gguf` on the CPU (held_quantized)."""
        return self.weight_format in ("fp8", "int4") and self.quantized_params > 0

    @property
    def held_as(self) -> str:
        """What weight_bytes holds the weights as, in a word or a few: the dtype, or the quantized format."""
        return self.weight_format_label if self.quantized_by_default else self.dtype

    @property
    def active_params(self) -> int:
        """Parameters one token computes with, for speed estimates: num_params less the experts it skips."""
        skipped = max(self.num_experts - self.experts_per_token, 0)
        return (
            self.num_params - self.sparse_layers * skipped * 3 * self.hidden_size * self.moe_intermediate_size
        )

    @property
    def float16(self) -> bool:
        """Whether the family runs in float16 (Gemma 2/3 overflow it: `auto` then picks bfloat16, or float32
        where the GPU has no bfloat16; the architecture table's `float16`)."""
        if not self.architecture:
            return True
        return architectures.architecture(self.architecture).float16

    def kv_bytes_per_token(self, kv_dtype: str | None = "auto", tp: int = 1) -> int:
        """KV bytes per token of the whole model, or of the rank with the most KV heads under tensor
        parallelism `tp` (engine_plan.kv_bytes_per_token); "auto" = the model's dtype. INT8 counts its
        per-token, per-head float32 scales (4 bytes per head and K|V)."""
        kv = kv_cache_dtype(kv_dtype, self.dtype)
        return kv_bytes_per_token(
            self.num_layers, self.num_attention_heads, self.num_kv_heads, self.head_dim, kv.element_bytes, tp,
            kv.scale_bytes,
        )  # fmt: skip

    def kv_head_bytes(self, kv_dtype: str | None = "auto") -> int:
        """Bytes of one token's K (or V) for one KV head, scales included."""
        kv = kv_cache_dtype(kv_dtype, self.dtype)
        return self.head_dim * kv.element_bytes + kv.scale_bytes

    def weight_bytes_as(self, dtype: str, quantized: bool | None = None) -> int:
        """Weight bytes if the float parameters are held in `dtype` (the CPU engine runs in float32) and the
        quantized linears in their format's bytes when `quantized` (None: quantized_by_default), else
        dequantized to `dtype` as well."""
        keep = self.quantized_by_default if quantized is None else quantized and self.quantized_params > 0
        if self.num_params:
            dense = self.num_params - (self.quantized_params if keep else 0)
            return dense * dtype_bytes(dtype) + (
                self.quantized_bytes + self.quantized_extra_bytes if keep else 0
            )
        return self.weight_bytes * dtype_bytes(dtype) // dtype_bytes(self.dtype)

    def with_dtype(self, dtype: str, quantized: bool | None = None) -> ModelShape:
        return replace(self, dtype=dtype, weight_bytes=self.weight_bytes_as(dtype, quantized))

    def weights_in_words(self, dtype: str | None = None, quantized: bool | None = None) -> str:
        """The weights' format as a plan reports it: "bfloat16" for a float checkpoint, else the format seen
        and how the engine holds it ("int4 (awq, group 128, asymmetric), 4.19 bits per linear weight ...")."""
        dtype = dtype or self.dtype
        if not self.weight_format:
            return dtype
        keep = self.quantized_by_default if quantized is None else quantized and self.quantized_params > 0
        if not keep:
            return f"{self.weight_format_label}, dequantized to {dtype} at load"
        bits = 8.0 * self.quantized_bytes / self.quantized_params
        return (
            f"{self.weight_format_label}: {self.quantized_params / 1e9:.3g}B linear weights at {bits:.4g} bits "
            f"each (scales and zero points included), the other {(self.num_params - self.quantized_params) / 1e9:.3g}B "
            f"parameters in {dtype}"
        )

    def with_weight_format(self, fmt: WeightFormat | None) -> ModelShape:
        """This shape holding `fmt`'s quantized linears (weight_bytes recounted); None: unchanged."""
        if fmt is None:
            return self
        shape = replace(
            self,
            weight_format=fmt.format,
            weight_format_label=fmt.label,
            quantized_params=fmt.quantized_params,
            quantized_bytes=fmt.quantized_bytes,
            quantized_extra_bytes=fmt.extra_bytes,
        )
        return replace(shape, weight_bytes=shape.weight_bytes_as(shape.dtype))

    def linears(self) -> list[Linear]:
        """The decoder linears a quantized checkpoint of this shape may quantize (weight_format.py)."""
        return decoder_linears(
            num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, sparse_layers=self.sparse_layers,
            num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_num_params(
    *,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool = False,
    qkv_bias: bool = False,
    sparse_layers: int = 0,
    num_experts: int = 0,
    moe_intermediate_size: int = 0,
) -> int:
    """Parameters of a Llama-family decoder (gated MLP, RMSNorm), used when no weights are at hand; in
    `sparse_layers` of them the MLP is `num_experts` gated experts of `moe_intermediate_size` and a router
    (Qwen3-MoE, Mixtral): every expert's weights are held, whichever few a token uses."""
    q, kv = num_attention_heads * head_dim, num_kv_heads * head_dim
    attn = hidden_size * (q + 2 * kv) + q * hidden_size + ((q + 2 * kv) if qkv_bias else 0)
    mlp = 3 * hidden_size * intermediate_size
    per_layer = attn + mlp + 2 * hidden_size
    embed = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    experts = num_experts * 3 * hidden_size * moe_intermediate_size + hidden_size * num_experts
    return num_layers * per_layer + sparse_layers * (experts - mlp) + embed + hidden_size


@dataclass(frozen=True)
class _Known:
    """One catalogue row: a public model's config.json values (a multimodal checkpoint's text decoder)."""

    name: str
    family: str  # its entry in the architecture table (architectures.py)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    window: int | None = None  # sliding_window
    window_layers: int | None = None  # how many layers slide (None: all, when window is set)
    tied: bool = False  # tie_word_embeddings
    qkv_bias: bool = False
    softcap: float | None = None  # attn_logit_softcapping
    # The checkpoint's `architectures` where the hub publishes a multimodal wrapper around this decoder (Gemma 3
    # 4B-27B): the engine serves its language model, text only; the catalogue's shape is that decoder's.
    published_as: str | None = None
    experts: int = 0  # num_experts (num_local_experts): every layer sparse
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    # quantization_config.quant_method of the published checkpoint where the engine undoes it at load (gpt-oss's
    # MXFP4 experts): the row's bytes are then what the engine holds, the dequantized bfloat16 weights
    published_quant: str | None = None


def _gemma3(name: str, layers: int, heads: int, kv: int, hd: int, hidden: int, inter: int) -> _Known:
    """Gemma 3's text decoder: five 1,024-token sliding layers to each global one (layer i slides unless
    (i + 1) % 6 == 0), a 262,208-token tied vocabulary, 128k positions; published inside a multimodal
    checkpoint (Gemma3ForConditionalGeneration, with a SigLIP vision tower)."""
    return _Known(name, "gemma3", layers, heads, kv, hd, hidden, inter, 262208, 131072, 1024,
                  layers - layers // 6, tied=True, published_as="Gemma3ForConditionalGeneration")  # fmt: skip


def _gemma2(name: str, layers: int, heads: int, kv: int, hd: int, hidden: int, inter: int) -> _Known:
    """Gemma 2: every other layer (the even ones) a 4,096-token window, attention scores soft-capped at 50."""
    return _Known(name, "gemma2", layers, heads, kv, hd, hidden, inter, 256000, 8192, 4096,
                  (layers + 1) // 2, tied=True, softcap=50.0)  # fmt: skip


# Public config.json values of the models users deploy; keyed by the normalised id (_normalise_id).
_WELL_KNOWN = {row.name.lower(): row for row in (
    _Known("Llama-3.1-8B", "llama", 32, 32, 8, 128, 4096, 14336, 128256, 131072),
    _Known("Llama-3.1-70B", "llama", 80, 64, 8, 128, 8192, 28672, 128256, 131072),
    _Known("Llama-3.1-405B", "llama", 126, 128, 8, 128, 16384, 53248, 128256, 131072),
    _Known("Mistral-7B-v0.1", "mistral", 32, 32, 8, 128, 4096, 14336, 32000, 32768, 4096),
    _Known("Mistral-7B-v0.3", "mistral", 32, 32, 8, 128, 4096, 14336, 32768, 32768),
    _Known("Qwen2.5-7B", "qwen2", 28, 28, 4, 128, 3584, 18944, 152064, 32768, qkv_bias=True),
    _Known("Qwen2.5-72B", "qwen2", 80, 64, 8, 128, 8192, 29568, 152064, 32768, qkv_bias=True),
    _Known("SmolLM2-135M", "llama", 30, 9, 3, 64, 576, 1536, 49152, 8192, tied=True),
    _Known("Qwen3-8B", "qwen3", 36, 32, 8, 128, 4096, 12288, 151936, 40960),
    _Known("Qwen3-32B", "qwen3", 64, 64, 8, 128, 5120, 25600, 151936, 40960),
    _gemma3("Gemma-3-4B", 34, 8, 4, 256, 2560, 10240),
    _gemma3("Gemma-3-12B", 48, 16, 8, 256, 3840, 15360),
    _gemma3("Gemma-3-27B", 62, 32, 16, 128, 5376, 21504),
    _gemma2("Gemma-2-9B", 42, 16, 8, 256, 3584, 14336),
    _gemma2("Gemma-2-27B", 46, 32, 16, 128, 4608, 36864),
    _Known("Phi-4", "phi3", 40, 40, 10, 128, 5120, 17920, 100352, 16384),
    # Phi-3.5-mini's config.json sets a 262,144-token window, longer than its 131,072 positions
    _Known("Phi-3.5-mini", "phi3", 32, 32, 32, 96, 3072, 8192, 32064, 131072, 262144),
    _Known("Granite-3.3-8B", "granite", 40, 32, 8, 128, 4096, 12800, 49159, 131072, tied=True),
    _Known("Qwen3-30B-A3B", "qwen3_moe", 48, 32, 4, 128, 2048, 6144, 151936, 40960, experts=128,
           experts_per_tok=8, moe_intermediate=768),
    _Known("Mixtral-8x7B", "mixtral", 32, 32, 8, 128, 4096, 14336, 32000, 32768, experts=8, experts_per_tok=2,
           moe_intermediate=14336),
    # gpt-oss: every other layer (the even ones) a 128-token window; experts published as MXFP4, held dequantized
    _Known("gpt-oss-20b", "gpt_oss", 24, 64, 8, 64, 2880, 2880, 201088, 131072, 128, 12, qkv_bias=True,
           experts=32, experts_per_tok=4, moe_intermediate=2880, published_quant="mxfp4"),
    _Known("gpt-oss-120b", "gpt_oss", 36, 64, 8, 64, 2880, 2880, 201088, 131072, 128, 18, qkv_bias=True,
           experts=128, experts_per_tok=4, moe_intermediate=2880, published_quant="mxfp4"),
)}  # fmt: skip
_ALIASES = {
    "mistral-7b": "mistral-7b-v0.3",
    "mistral-7b-v0.2": "mistral-7b-v0.3",
    "llama3.1-8b": "llama-3.1-8b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
}


def _normalise_id(model_id: str) -> str:
    """A name or hub id as the catalogue keys it: the repository name, lower case, without the suffixes
    instruct and base checkpoints differ by (-Instruct, -it, -pt, -Base: they share a shape)."""
    name = str(model_id).strip().rstrip("/").split("/")[-1].lower()
    name = name.removeprefix("meta-").removesuffix("-hf")
    name = re.sub(r"-instruct\b", "", name)
    name = re.sub(r"-(it|pt|base)$", "", name)
    name = name.replace("llama3.1", "llama-3.1")
    return _ALIASES.get(name, name)


# Name suffixes publishers give the quantized checkpoints of a model (Qwen/Qwen3-8B-AWQ, ...-GPTQ-Int4,
# ...-FP8, unsloth's ...-bnb-4bit), and the config.json quantization_config.quant_method each one implies.
_QUANTIZED_SUFFIX = re.compile(r"-(awq|gptq|fp8|bnb)(?:-[a-z0-9]+)*$")
# Their quant_method; the rest of the published quantization_config is read with detect's defaults (4-bit,
# group 128: what these releases publish), which sizing counts.
_QUANT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "bnb": "bitsandbytes"}


def _quantized_variant(model_id: str) -> tuple[_Known, dict] | None:
    """(the catalogue model, its quantization_config) for a quantized checkpoint of a catalogue model, by its
    name."""
    name = _normalise_id(model_id)
    found = _QUANTIZED_SUFFIX.search(name)
    if found is None:
        return None
    row = _WELL_KNOWN.get(_normalise_id(name[: found.start()]))
    return None if row is None else (row, {"quant_method": _QUANT_METHODS[found.group(1)]})


def well_known_model_ids() -> list[str]:
    return sorted(row.name for row in _WELL_KNOWN.values())


def well_known_shape(model_id: str) -> ModelShape | None:
    """The published shape of a popular model by name or hub id (meta-llama/Llama-3.1-8B-Instruct,
    google/gemma-3-27b-it: a multimodal checkpoint's text decoder, which is what the engine serves)."""
    row = _WELL_KNOWN.get(_normalise_id(model_id))
    if row is None:
        variant = _quantized_variant(model_id)
        if variant is None:
            return None
        base = well_known_shape(variant[0].name)
        assert base is not None
        scheme = quantization_scheme(
            {"quantization_config": variant[1]}, f"{model_id}'s config.json as published"
        )
        return replace(base, name=str(model_id).rstrip("/").split("/")[-1]).with_weight_format(
            scheme_format(scheme, base.linears()) if scheme is not None else None
        )
    n = estimate_num_params(
        num_layers=row.layers, num_attention_heads=row.heads, num_kv_heads=row.kv_heads, head_dim=row.head_dim,
        hidden_size=row.hidden, intermediate_size=row.intermediate, vocab_size=row.vocab,
        tie_word_embeddings=row.tied, qkv_bias=row.qkv_bias, num_experts=row.experts,
        moe_intermediate_size=row.moe_intermediate, sparse_layers=row.layers if row.experts else 0,
    )  # fmt: skip
    return ModelShape(
        row.name, row.layers, row.heads, row.kv_heads, row.head_dim, row.hidden, row.intermediate, row.vocab,
        row.max_positions, row.window, "bfloat16", 2 * n, n, row.tied, row.softcap,
        row.window_layers if row.window else None, row.family, row.experts, row.experts_per_tok,
        row.moe_intermediate, row.layers if row.experts else 0,
    )  # fmt: skip


def well_known_config(model_id: str) -> dict | None:
    """The published config.json of a catalogue model as far as the engine's strict reader decides on it (its
    family, a multimodal wrapper, the shape, the quantization_config of a quantized checkpoint named as such:
    Qwen/Qwen3-8B-AWQ), for checks where the checkpoint is not at hand (the operator, before any download);
    None if unknown."""
    row, quant = _WELL_KNOWN.get(_normalise_id(model_id)), None
    if row is None and (variant := _quantized_variant(model_id)) is not None:
        row, quant = variant
    if row is None:
        return None
    quantized = {"quantization_config": quant} if quant else {}
    family = architectures.architecture(row.family)
    text = {
        "model_type": family.model_types[0], "architectures": [family.hf_architectures[0]],
        "num_hidden_layers": row.layers, "num_attention_heads": row.heads, "num_key_value_heads": row.kv_heads,
        "head_dim": row.head_dim, "hidden_size": row.hidden, "intermediate_size": row.intermediate,
        "vocab_size": row.vocab, "max_position_embeddings": row.max_positions, "tie_word_embeddings": row.tied,
    }  # fmt: skip
    if row.experts:
        text |= {"num_experts": row.experts, "num_experts_per_tok": row.experts_per_tok,
                 "moe_intermediate_size": row.moe_intermediate, "norm_topk_prob": True}  # fmt: skip
    if row.published_quant and not quantized:  # gpt-oss's MXFP4, as published (the engine dequantizes it)
        quantized = {"quantization_config": {"quant_method": row.published_quant}}
    if row.published_as is None:
        return text | quantized
    return {
        "model_type": family.multimodal_model_types[0],
        "architectures": [row.published_as],
        "text_config": text,
        **quantized,
    }


def check_published_config(model_id: str) -> None:
    """Raise UnsupportedModelError, in the engine's own words, for a catalogue model (or a quantized checkpoint
    named after one) whose published checkpoint the engine refuses; the one check for every place that decides
    before the weights are at hand (serve's dry run, `pagoda plan`, the operator). Unknown ids pass."""
    published = well_known_config(model_id)
    if published is not None:
        ModelConfig.from_hf_config(published, where=f"{model_id}'s config.json as published")


def well_known_family(model_id: str) -> str | None:
    """The architecture-table family of a catalogue model (None if it is not in the catalogue)."""
    row = _WELL_KNOWN.get(_normalise_id(model_id))
    return row.family if row else None


def shape_from_config(
    config: dict, weight_bytes: int | None = None, *, name: str | None = None, where: str = "config.json"
) -> ModelShape:
    """Shape from a Hugging Face config dict, read by the engine's own reader (ModelConfig, leniently: any
    Llama-shaped decoder); weight bytes estimated from the shape when not given. A quantized checkpoint's
    (quantization_config) linears are counted in their format's bytes (weight_format.py); a scheme the engine
    does not run is refused with the engine's message (UnsupportedModelError)."""
    scheme = quantization_scheme(config, where)
    if scheme is not None:  # read by the scheme's own detection, the rest as a float checkpoint's
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {
                k: v for k, v in config["text_config"].items() if k != "quantization_config"
            }
    mc = ModelConfig.from_hf_config(config, strict=False, where=where)
    dtype = str(mc.torch_dtype or "bfloat16").removeprefix("torch.")
    try:
        if dtype_bytes(dtype) == 1:
            dtype = "bfloat16"
    except SizingError:
        dtype = "bfloat16"
    n = estimate_num_params(
        num_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, vocab_size=mc.vocab_size, tie_word_embeddings=mc.tie_word_embeddings,
        qkv_bias=mc.attention_bias, num_experts=mc.num_experts, moe_intermediate_size=mc.moe_intermediate_size,
        sparse_layers=sum(mc.layer_is_sparse(i) for i in range(mc.num_hidden_layers)),
    )  # fmt: skip
    if weight_bytes is not None:
        n = weight_bytes // dtype_bytes(dtype)
    label = name or config.get("_name_or_path") or config.get("model_type") or "model"
    sliding_layers = None
    if mc.sliding_window is not None and mc.layer_types is not None:
        sliding_layers = sum(mc.layer_sliding_window(i) is not None for i in range(mc.num_hidden_layers))
    shape = ModelShape(
        str(label), mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
        mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings, mc.sliding_window,
        dtype, n * dtype_bytes(dtype) if weight_bytes is None else weight_bytes, n, mc.tie_word_embeddings,
        mc.attn_logit_softcapping, sliding_layers, mc.architecture, mc.num_experts, mc.num_experts_per_tok,
        mc.moe_intermediate_size, sum(mc.layer_is_sparse(i) for i in range(mc.num_hidden_layers)),
    )  # fmt: skip
    if scheme is None or scheme.format == "gguf":
        return shape
    return shape.with_weight_format(scheme_format(scheme, shape.linears()))


def quantization_scheme(config: dict, where: str = "config.json") -> QuantScheme | None:
    """The checkpoint's quantization (config.json's quantization_config, a multimodal wrapper's or its
    text_config's) by the engine's own detection; None for float weights (and for MXFP4 experts, which the
    loader dequantizes)."""
    from pagoda.engine.sizing.model_config import dequantized_at_load

    config = dequantized_at_load(config)
    quant = config.get("quantization_config")
    if quant is None and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if not quant:
        return None
    from pagoda.engine.quantization.detect import UnsupportedQuantizationError, detect_quantization

    try:
        return detect_quantization({**config, "quantization_config": quant}, where)
    except UnsupportedQuantizationError as exc:
        raise UnsupportedModelError(str(exc)) from None


def safetensors_weight_bytes(directory: Path, skip: tuple[str, ...] = ()) -> tuple[int, int, str | None]:
    """(bytes, parameters, dominant dtype) of every *.safetensors file, reading only their JSON headers;
    tensors named with a prefix in `skip` (a multimodal checkpoint's vision tower) are not counted."""
    total = params = 0
    by_dtype: dict[str, int] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SizingError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * (1 << 20):
                raise SizingError(f"{path}: safetensors header claims {n} bytes; the file is damaged")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise SizingError(f"{path}: safetensors header is not valid JSON ({e})") from None
        for key, info in header.items():
            if key == "__metadata__" or key.startswith(skip):
                continue
            begin, end = info["data_offsets"]
            total += end - begin
            count = math.prod(info["shape"])
            params += count
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + count
    dominant = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return total, params, _SAFETENSORS_DTYPE.get(dominant or "")


def shape_from_path(path: str | Path) -> ModelShape:
    """Shape of a local model: a Hugging Face directory or a GGUF file. Weights are never loaded."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _shape_from_gguf(p)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return _shape_from_gguf(ggufs[0])
            raise SizingError(f"{p}: no config.json (and not exactly one .gguf file) in the model directory")
        try:
            config = json.loads(cfg.read_text())
        except ValueError as e:
            raise SizingError(f"{cfg}: not valid JSON ({e})") from None
        wrapper = architectures.multimodal_of(config)  # served text only: the vision tower is not loaded
        nbytes, params, st_dtype = safetensors_weight_bytes(p, wrapper.multimodal_skipped if wrapper else ())
        if params and not (config.get("torch_dtype") or config.get("dtype")) and st_dtype:
            config = {**config, "torch_dtype": st_dtype}
        shape = shape_from_config(config, None, name=p.name, where=str(cfg))
        if params and not shape.weight_format:  # a quantized file's elements are packed: keep the estimate
            shape = replace(shape, num_params=params, weight_bytes=params * dtype_bytes(shape.dtype))
        return shape
    if p.exists():
        raise SizingError(f"{p}: expected a model directory (config.json) or a .gguf file")
    raise SizingError(f"{p}: no such file or directory")


def _shape_from_gguf(path: Path) -> ModelShape:
    from pagoda.engine.sizing.gguf_meta import ArrayLength, read_gguf_meta

    meta = read_gguf_meta(path)
    arch = meta.get("general.architecture")
    if not arch:
        raise SizingError(f"{path}: GGUF metadata has no general.architecture")

    def field(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> int:
        value = field(key)
        if value is None:
            raise SizingError(f"{path}: GGUF metadata is missing {arch}.{key}, which sizing needs")
        return int(value)

    layers, heads, hidden = need("block_count"), need("attention.head_count"), need("embedding_length")
    kv = field("attention.head_count_kv", heads)
    kv = int(kv[0] if isinstance(kv, list) else kv)  # some architectures store one value per layer
    head_dim = int(field("attention.key_length", 0) or hidden // heads)
    vocab = field("vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = tokens.length if isinstance(tokens, ArrayLength) else len(tokens or [])
    window = field("attention.sliding_window")
    params = sum(math.prod(dims) for dims in meta.tensors.values())
    try:
        family = architectures.from_gguf(arch, str(path))
    except ValueError:
        family = architectures.GENERIC  # sized as a Llama-shaped decoder; the engine refuses it
    if arch == "llama" and field("expert_count"):  # llama.cpp writes Mixtral as a Llama with experts
        family = architectures.architecture("mixtral")
    # llama.cpp's keys as config.json's, read by the engine's own reader (windows per layer by the family)
    config = {
        "model_type": family.model_types[0] if family.model_types else arch,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "hidden_size": hidden, "intermediate_size": int(field("feed_forward_length", 4 * hidden)),
        "vocab_size": int(vocab), "max_position_embeddings": int(field("context_length", 2048)),
        "sliding_window": int(window) if window else None,
        "attn_logit_softcapping": field("attn_logit_softcapping"),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "torch_dtype": "float16" if family.float16 else "bfloat16",  # what the engine dequantises to
        # a mixture of experts: all experts weigh, the used ones set the speed
        "num_local_experts": field("expert_count"), "num_experts_per_tok": field("expert_used_count"),
        "moe_intermediate_size": field("expert_feed_forward_length"),
    }  # fmt: skip
    # the file name, not general.name (often a training-run name): the file name is what users typed. Sized
    # dequantized (what the engine holds by default); its blocks are counted for `--quantization gguf`.
    shape = shape_from_config(config, 2 * params, name=path.stem, where=str(path))
    return shape.with_weight_format(gguf_format(meta.tensors, meta.tensor_types))
