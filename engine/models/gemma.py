"""Gemma 2 and Gemma 3 (text) decoders over a paged KV cache.

Gemma is a Llama-shaped decoder with these differences, each read from the ModelConfig (through it the
architecture table), and built from the Llama blocks otherwise:
- RMSNorm scales by (1 + w): the checkpoint's w is folded into our norms' weights on load, so the fused
  norm kernels run unchanged;
- token embeddings times sqrt(hidden_size), rounded to the compute dtype as the reference does;
- GeGLU MLP: GELU (tanh approximation for `gelu_pytorch_tanh`) on the gate;
- sandwich norms: the attention's and the MLP's outputs are normalised before each residual add, and a
  pre-feed-forward norm feeds the MLP;
- attention scale query_pre_attn_scalar**-0.5; Gemma 2's scores soft-capped (the backend's `logit_softcap`)
  and its final logits too (`finish_logits`); Gemma 3's QK-norm instead;
- per-layer attention: sliding layers (Gemma 2 every other one, Gemma 3 five of six) with their window, and
  on Gemma 3 their own RoPE base (rope_local_base_freq) without the global layers' scaling.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from pagoda.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache
from pagoda.engine.attention.bound import BoundBackend
from pagoda.engine.distributed.parallel_state import all_reduce
from pagoda.engine.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluMLP,
    rotary_dim,
)
from pagoda.engine.models.llama import Attention, LlamaForCausalLM, uses_triton_kernels
from pagoda.engine.quantization.scheme import QuantScheme
from pagoda.engine.sizing.model_config import ModelConfig
from torch import nn

_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


class GeluMLP(SiluMLP):
    """down(gelu(gate(x)) * up(x)) (GeGLU), sharded over tensor-parallel ranks as SiluMLP is."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        dtype: torch.dtype,
        device: torch.device,
        scheme: QuantScheme | None = None,
        prefix: str = "mlp",
    ):
        super().__init__(hidden, intermediate, False, dtype, device, scheme=scheme, prefix=prefix)
        if act not in _GELU_APPROXIMATION:
            raise ValueError(f"hidden activation {act!r} is not supported ({', '.join(_GELU_APPROXIMATION)})")
        self.approximate = _GELU_APPROXIMATION[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(F.gelu(gate, approximate=self.approximate).mul_(up)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        triton = uses_triton_kernels(backend)

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, triton)

        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, backend, dtype, device)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GeluMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            dtype,
            device,
            config.quantization,
            f"model.layers.{layer}.mlp",
        )
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised mlp output, residual stream before it): as in the Llama layer, each residual add is
        fused into the norm that follows it."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, cache, meta))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """`model(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]`; `compute_logits` -> float32
    (the Llama head, which applies final_logit_softcapping). Checkpoint names and tensor-parallel shards as
    in the Llama model, plus the feed-forward norms."""

    decoder_layer = GemmaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_model_len: int | None = None,
    ):
        if dtype == torch.float16 and not config.family.float16:
            raise ValueError(
                f"{config.architecture} overflows float16 (it was trained in bfloat16): use --dtype bfloat16 "
                "or float32"
            )
        super().__init__(config, backend, dtype, device, max_model_len)
        # sqrt(hidden) in the compute dtype, as the reference multiplies (bfloat16: 55.4256 -> 55.5).
        scale = torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=self.norm.weight.device)
        self.register_buffer("embed_scale", scale, persistent=False)

    def layer_backend(self, backend: AttentionBackend) -> AttentionBackend:
        cap = self.config.attn_logit_softcapping if self.config.family.attn_logit_softcap else None
        return BoundBackend(backend, logit_softcap=cap) if cap else backend

    def set_max_model_len(self, max_model_len: int | None, device: torch.device | None = None) -> None:
        """(Re)build the rotary tables: one per distinct (base, scaling) among the layers (Gemma 3: the
        sliding layers' local base unscaled, the global layers' base with the config's scaling)."""
        c = self.config
        if device is None:
            device = self.rotaries[0].inv_freq.device
        kinds: list[tuple[float, dict | None]] = []
        self.layer_rotary: list[int] = []
        for layer in range(c.num_hidden_layers):
            local = c.rope_local_base_freq is not None and c.layer_sliding_window(layer) is not None
            kind = (c.layer_rope_theta(layer), None if local else c.rope_scaling)
            if kind not in kinds:
                kinds.append(kind)
            self.layer_rotary.append(kinds.index(kind))
        dim = rotary_dim(c.head_dim, c.partial_rotary_factor)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(dim, theta, scaling, c.max_position_embeddings, device, max_model_len)
            for theta, scaling in kinds
        )

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The inverse frequencies of one layer's rotary (attention-sink keys are re-rotated with them)."""
        return self.rotaries[self.layer_rotary[layer]].inv_freq

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model has {len(self.layers)}")
        x = self.embed_tokens(input_ids) * self.embed_scale
        top = meta.max_seq_len if meta.max_position is None else meta.max_position
        tables = [rotary.cos_sin(positions, top, x.dtype) for rotary in self.rotaries]
        residual = None
        for layer, cache, which in zip(self.layers, kv_caches, self.layer_rotary, strict=True):
            cos, sin = tables[which]
            x, residual = layer(x, residual, cos, sin, cache, meta)
        return self.norm.add_forward(x, residual)[0]

    # ---- weights ------------------------------------------------------------------------------------

    def _target(self, name: str) -> tuple[torch.Tensor, int, int, tuple[int, list[int]] | None] | None:
        parts = name.removeprefix("model.").split(".")
        if (
            len(parts) == 4
            and parts[0] == "layers"
            and parts[2] in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            and parts[3] == "weight"
        ):
            return (getattr(self.layers[int(parts[1])], parts[2]).weight, 0, self.config.hidden_size, None)
        return super()._target(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama loader over the checkpoint's tensors, each norm's w turned into the 1 + w it scales by
        (computed in float32, then stored in the compute dtype); a multimodal checkpoint's language model
        under its decoder's names, its vision tower and projector skipped."""
        if self.config.multimodal_checkpoint:
            weights = _language_model_weights(weights, self.config.family.multimodal_skipped)
        super().load_weights(_offset_norms(weights))


# A multimodal Gemma 3 checkpoint's language model as a text checkpoint names it: the layout of the published
# checkpoints (transformers 4.50, and what transformers 5 still writes) and transformers 5's in-memory one.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


def _language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]], skipped: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors renamed as a text checkpoint's; the vision tower's and projector's
    (`skipped`, the table's) dropped; any other name passes unchanged, so the loader refuses it by name."""
    for name, tensor in weights:
        if name.startswith(skipped):
            continue
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


def _offset_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every norm's checkpoint w as 1 + w in float32 (exact there; one rounding to the compute dtype after),
    so our RMSNorm's plain `w * x` is Gemma's `(1 + w) * x`."""
    for name, tensor in weights:
        yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
