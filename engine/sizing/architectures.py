"""The one table of model architectures: the only place an architecture is named.

Each entry says how a family is recognised (config.json's `model_type` and `architectures`, a GGUF file's
`general.architecture`), how its GGUF tensors are turned back into Hugging Face ones, which model module
builds it, and the structural features it turns on. The config reader (model_config), the model builder
(engine/models), the loader and GGUF converter (engine/loader), the dry run and the planner's shapes all read
it. Adding a family is one entry here plus, where its shape differs, a model module and its tests.

Pure Python, no torch: the operator and the planner read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One model family as the engine runs it."""

    name: str  # our name for the family (ModelConfig.architecture)
    hf_architectures: tuple[
        str, ...
    ]  # config.json `architectures` (the first is what the GGUF converter writes)
    model_types: tuple[str, ...]  # config.json `model_type` values
    module: str = "llama"  # pagoda.engine.models.<module> builds it
    model_class: str = "LlamaForCausalLM"  # ... with this class
    gguf_arch: str | None = None  # a GGUF file's general.architecture; None: not loaded from GGUF
    gguf_permuted_qk: bool = False  # llama.cpp interleaved the rotary halves of q/k rows (undone on load)
    gguf_norm_shift: float = 0.0  # llama.cpp added it to each *norm.weight (Gemma: 1); undone on load
    # GGUF has no key for Gemma's query_pre_attn_scalar: llama.cpp takes head_dim (transformers' 256), except
    # for the layer counts listed here (the 27B models), where it is hidden_size / num_attention_heads.
    gguf_width_scaled_layers: tuple[int, ...] = ()
    qkv_bias: bool = False  # q/k/v projections carry a bias unless config.json says attention_bias
    # Sliding windows: "config" = wherever config.json sets sliding_window (use_sliding_window: false turns it
    # off); "opt_in" = only with use_sliding_window: true, and then from max_window_layers on (Qwen2).
    sliding_window: str = "config"
    # Where config.json lists no layer_types: every Nth layer attends fully, the others slide (Gemma 2: 2,
    # Gemma 3: 6; a config's sliding_window_pattern overrides); 0 = no such rule.
    sliding_pattern: int = 0
    rope_scalings: tuple[str, ...] = ("llama3", "linear")  # rope_scaling types the model implements
    # Structural features later families turn on (each read by the model module that implements it).
    qk_norm: bool = False  # RMSNorm per head on q and k
    post_norms: bool = False  # norms after attention and MLP too (sandwich norm)
    attn_logit_softcap: bool = False  # soft-capping of attention scores and final logits
    attention_sinks: bool = False  # learned per-head sink logits
    experts: bool = False  # mixture-of-experts MLP
    norm_topk_prob: bool = True  # experts: renormalise the top-k routing weights where config.json is silent
    # The checkpoint stores q/k/v as one `self_attn.qkv_proj` and gate/up as one `mlp.gate_up_proj` (Phi-3);
    # the loader splits them into their parts before sharding each.
    fused_checkpoint: bool = False
    weight_formats: tuple[str, ...] = ("float32", "float16", "bfloat16")  # checkpoint formats it loads
    # tie_word_embeddings where config.json omits it: the family's config class default in transformers (Gemma:
    # True). transformers 4.x wrote no key whose value equals the base class's (True), so Gemma 2 files lack it.
    tied_embeddings_default: bool = False
    # False: activations overflow float16 (Gemma 2/3): dtype auto picks bfloat16, an explicit float16 is refused.
    float16: bool = True
    # model_type of the family's multimodal checkpoints (Gemma 3 4B-27B: Gemma3ForConditionalGeneration), whose
    # language model the engine serves text only: the decoder's config is their `text_config`, where a field it
    # omits takes the value of text_config_defaults (transformers' defaults of the family's text config); the
    # tensors named with a prefix of multimodal_skipped (the vision tower's, the projector's) are not loaded, and
    # not sized.
    multimodal_model_types: tuple[str, ...] = ()
    text_config_defaults: tuple[tuple[str, object], ...] = ()
    multimodal_skipped: tuple[str, ...] = ()


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "llama",
        ("LlamaForCausalLM",),
        ("llama", "smollm", "smollm2"),
        gguf_arch="llama",
        gguf_permuted_qk=True,
    ),
    Architecture(
        "mistral",
        ("MistralForCausalLM",),
        ("mistral",),
        gguf_arch="mistral",
        gguf_permuted_qk=True,
    ),
    Architecture(
        "qwen2",
        ("Qwen2ForCausalLM",),
        ("qwen2",),
        gguf_arch="qwen2",
        qkv_bias=True,
        sliding_window="opt_in",
        rope_scalings=("llama3", "linear", "yarn"),
    ),
    Architecture(
        "qwen3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        gguf_arch="qwen3",
        sliding_window="opt_in",
        rope_scalings=("llama3", "linear", "yarn"),
        qk_norm=True,
    ),
    Architecture(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3_moe",),
        gguf_arch="qwen3moe",
        sliding_window="opt_in",
        rope_scalings=("llama3", "linear", "yarn"),
        qk_norm=True,
        experts=True,
        norm_topk_prob=False,  # transformers' default; Qwen3-30B-A3B's config.json sets it true
    ),
    Architecture(
        "mixtral",
        ("MixtralForCausalLM",),
        ("mixtral",),
        experts=True,
    ),
    Architecture(
        "gpt_oss",
        ("GptOssForCausalLM",),
        ("gpt_oss",),
        module="gpt_oss",
        model_class="GptOssForCausalLM",
        gguf_arch="gpt-oss",
        rope_scalings=("yarn",),
        attention_sinks=True,
        experts=True,
        weight_formats=("float32", "float16", "bfloat16", "mxfp4"),  # MXFP4 experts dequantized at load
    ),
    Architecture(
        "phi3",
        ("Phi3ForCausalLM",),
        ("phi3",),
        gguf_arch="phi3",
        rope_scalings=("longrope", "linear"),  # config.json's older "su" is read as "longrope"
        fused_checkpoint=True,
    ),
    Architecture(
        "granite",
        ("GraniteForCausalLM",),
        ("granite",),
        gguf_arch="granite",
        gguf_permuted_qk=True,  # llama.cpp converts Granite as a Llama (rows interleaved)
    ),
    Architecture(
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        module="gemma",
        model_class="GemmaForCausalLM",
        gguf_arch="gemma2",
        gguf_norm_shift=1.0,
        gguf_width_scaled_layers=(46,),
        sliding_pattern=2,
        post_norms=True,
        attn_logit_softcap=True,
        tied_embeddings_default=True,
        float16=False,
    ),
    Architecture(
        "gemma3",
        ("Gemma3ForCausalLM",),
        ("gemma3_text",),
        module="gemma",
        model_class="GemmaForCausalLM",
        gguf_arch="gemma3",
        gguf_norm_shift=1.0,
        gguf_width_scaled_layers=(62,),
        sliding_pattern=6,
        qk_norm=True,
        post_norms=True,
        tied_embeddings_default=True,
        float16=False,
        multimodal_model_types=("gemma3",),
        # transformers' Gemma3TextConfig defaults (4.50 to 5.x): the 4B's published text_config gives only its
        # sizes, window and rope_scaling; its heads, head_dim, vocabulary and RoPE bases are these
        text_config_defaults=(
            ("vocab_size", 262208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("hidden_activation", "gelu_pytorch_tanh"),
            ("max_position_embeddings", 131072),
            ("rms_norm_eps", 1e-6),
            ("bos_token_id", 2),
            ("eos_token_id", 1),
            ("tie_word_embeddings", True),
            ("attention_bias", False),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 4096),
            ("sliding_window_pattern", 6),
            ("rope_theta", 1_000_000.0),
            ("rope_local_base_freq", 10_000.0),
        ),
        # the SigLIP tower and its projector into the decoder's width, by the published checkpoints' names and by
        # transformers 5's
        multimodal_skipped=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
)
SUPPORTED_ARCHITECTURES = tuple(a.name for a in ARCHITECTURES)
# A decoder sizing was given the shape of without saying its family (spec.model.shape, --model-shape): a
# Llama-shaped one, every feature read from the config itself.
GENERIC = Architecture("", (), ())

_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
_BY_HF_ARCHITECTURE = {h: a for a in ARCHITECTURES for h in a.hf_architectures}
_BY_MULTIMODAL = {t: a for a in ARCHITECTURES for t in a.multimodal_model_types}
_BY_GGUF = {a.gguf_arch: a for a in ARCHITECTURES if a.gguf_arch}
GGUF_ARCHITECTURES = tuple(_BY_GGUF)


def architecture(name: str) -> Architecture:
    """The entry of a family by our name; a ValueError listing the supported ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def from_hf_config(config: dict) -> Architecture | None:
    """The entry config.json names (its model_type first, then its architectures); None if none."""
    found = _BY_MODEL_TYPE.get(config.get("model_type") or "")
    for hf_name in config.get("architectures") or []:
        found = found or _BY_HF_ARCHITECTURE.get(hf_name)
    return found


def multimodal_of(config: dict) -> Architecture | None:
    """The family whose multimodal checkpoint config.json is (the engine serves its language model only)."""
    return _BY_MULTIMODAL.get(config.get("model_type") or "")


def from_gguf(arch: str | None, where: str) -> Architecture:
    """The entry of a GGUF file's general.architecture; a ValueError naming the file otherwise."""
    found = _BY_GGUF.get(arch or "")
    if found is None:
        raise ValueError(
            f"GGUF file {where!r} has architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return found
