"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Our own forward: attention goes through an `AttentionBackend`, which owns the KV cache writes and the
paged attention; the model only projects, rotates and mixes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pagoda.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache
from pagoda.engine.models.config import ModelConfig
from pagoda.engine.models.layers import Linear, RMSNorm, RotaryEmbedding, SiluMLP, apply_rotary
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.backend = backend
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device
        )
        # Llama's attention_bias also covers o_proj; Qwen2 biases only q, k and v.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = SiluMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """`model(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]`; `compute_logits` -> float32."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device or "cpu")
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
            _freeze=True,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), False
            )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, device
        )

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
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, meta.max_seq_len, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (only the rows that need sampling) -> float32 logits [N, vocab]."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight).float()

    # ---- weights ------------------------------------------------------------------------------------

    def _target(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """Map a Hugging Face tensor name to (our parameter, row offset, rows); None = ignore it."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight":
            return (self.lm_head_weight, 0, self.config.vocab_size)
        if name == "embed_tokens.weight":
            return (self.embed_tokens.weight, 0, self.config.vocab_size)
        if name == "norm.weight":
            return (self.norm.weight, 0, self.config.hidden_size)
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 4:
            raise KeyError(name)
        layer = self.layers[int(parts[1])]
        sub = ".".join(parts[2:])
        attn, mlp, c = layer.self_attn, layer.mlp, self.config
        q, kv, inter = attn.q_size, attn.kv_size, c.intermediate_size
        table = {
            "self_attn.q_proj": (attn.qkv_proj, 0, q),
            "self_attn.k_proj": (attn.qkv_proj, q, kv),
            "self_attn.v_proj": (attn.qkv_proj, q + kv, kv),
            "self_attn.o_proj": (attn.o_proj, 0, c.hidden_size),
            "mlp.gate_proj": (mlp.gate_up_proj, 0, inter),
            "mlp.up_proj": (mlp.gate_up_proj, inter, inter),
            "mlp.down_proj": (mlp.down_proj, 0, c.hidden_size),
        }
        if sub in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return (getattr(layer, sub.split(".")[0]).weight, 0, c.hidden_size)
        module_name, _, kind = sub.rpartition(".")
        if module_name not in table or kind not in ("weight", "bias"):
            raise KeyError(name)
        module, offset, rows = table[module_name]
        param = getattr(module, kind)
        if param is None:
            raise KeyError(name)
        return (param, offset, rows)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters; every parameter must be set."""
        loaded: dict[int, int] = {}  # id(param) -> rows written
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            try:
                target = self._target(name)
            except (KeyError, ValueError, IndexError):
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in a {self.config.architecture} model"
                ) from None
            if target is None:
                continue
            param, offset, rows = target
            dest = param.narrow(0, offset, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded[id(param)] = loaded.get(id(param), 0) + rows
        missing = [
            n for n, p in self.named_parameters(remove_duplicate=True) if loaded.get(id(p), 0) != p.shape[0]
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
