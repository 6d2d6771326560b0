"""Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM, Phi-3/4, Granite, and with a mixture-of-experts
MLP Qwen3-MoE and Mixtral) over a paged KV cache.

Our own forward: attention goes through an `AttentionBackend`, which owns the KV cache writes and the
paged attention; the model only projects, rotates and mixes. What differs between the families is read
from the ModelConfig (and through it the architecture table), never from the family's name: QK-norm
(Qwen3), partial rotary (Phi-4-mini), fused checkpoint tensors (Phi-3), the scalings of RoPE (llama3,
yarn, LongRoPE), Granite's embedding, attention, residual and logits multipliers, and which layers' MLP is
the sparse one of engine/models/moe.py (`ModelConfig.layer_is_sparse`).

A CPU decode step is hundreds of short calls per layer, so the forward keeps its Python short: sub-modules
are called by their ``forward`` (no module registers hooks; `nn.Module.__call__` costs about a microsecond),
decisions that hold for a step are made once per step (cos/sin views, the linears' switches: `cpu_linear.refresh`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pagoda.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache
from pagoda.engine.distributed.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    kv_heads_of_rank,
    pp_state,
    shard_range,
    shard_widths,
    tp_rank,
    tp_size,
)
from pagoda.engine.models import cpu_linear, cpu_ops
from pagoda.engine.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluMLP,
    VocabParallelEmbedding,
    apply_rotary,
    dequantize_linears,
    finish_logits,
    make_linear,
    rotary_dim,
)
from pagoda.engine.models.moe import MOE_PREFIXES, SparseMoE
from pagoda.engine.sizing.errors import UnsupportedModelError
from pagoda.engine.sizing.model_config import ModelConfig
from torch import nn


def uses_triton_kernels(backend: AttentionBackend) -> bool:
    """The GPU path: with the Triton attention backend the layer's element-wise ops (RMSNorm with the
    residual add, rotary, silu-and-mul) are fused Triton kernels too; the torch backend (the CPU path)
    keeps its C kernels and torch expressions."""
    return getattr(backend, "name", None) == "triton"


_rows_entry: tuple = (None, None, None, None)  # cos, sin, and their [T, D] views: the last step's


def _rows_of(cos: torch.Tensor, sin: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D] as [T, D] views for the fused rotary kernels, made once per step rather than per
    layer (a one-entry cache on the tables' identity: every layer of a step gets the same two tensors; the
    entry is one tuple, read and replaced whole)."""
    global _rows_entry
    entry = _rows_entry
    if entry[0] is not cos or entry[1] is not sin:
        entry = _rows_entry = (cos, sin, cos.view(t, -1), sin.view(t, -1))
    return entry[2], entry[3]


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
        # Tensor parallelism: this rank's query heads and the KV heads they read (replicated across ranks
        # where needed); o_proj sums the ranks' partial outputs.
        self.q_heads = shard_range(config.num_attention_heads)
        self.kv_head_ids = kv_heads_of_rank(config.num_attention_heads, config.num_key_value_heads)
        self.num_heads = self.q_heads[1] - self.q_heads[0]
        self.num_kv_heads = len(self.kv_head_ids)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self._head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.scale = config.attention_scale
        self.rotary_dim = rotary_dim(config.head_dim, config.partial_rotary_factor)
        self.sliding_window = config.layer_sliding_window(layer)
        self.backend = backend
        self.triton = uses_triton_kernels(backend)
        # QK-norm (Qwen3): RMSNorm over each head's dims of q and of k, before rotary.
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device, self.triton)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device, self.triton)
        quant, prefix = config.quantization, f"model.layers.{layer}.self_attn"  # a quantized checkpoint's
        self.qkv_proj = make_linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.attention_bias,
            dtype,
            device,
            quant,
            f"{prefix}.qkv_proj",
        )
        # attention_bias also covers o_proj (Llama, Qwen3, Granite); a family whose q/k/v bias comes from the
        # table (Qwen2) biases only q, k and v.
        o_bias = config.attention_bias and not config.family.qkv_bias
        self.o_proj = make_linear(
            self.q_size,
            config.hidden_size,
            o_bias and tp_rank() == 0,
            dtype,
            device,
            quant,
            f"{prefix}.o_proj",
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # (.forward: no hooks here, and a module call costs ~1 us)
        if self.q_norm is not None:
            self._norm_qk_(qkv, t)
        rope_heads = self.num_heads + self.num_kv_heads  # q and k heads lie side by side in qkv
        # The fused kernels rotate whole heads; a partial rotary runs the torch expression.
        whole = self.rotary_dim == self.head_dim
        if self.triton and whole:  # the GPU path: q and k rotated in place in one launch
            from pagoda.kernels.rotary import rotary_

            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            rotary_(qkv, rope_heads, self.head_dim, cos.view(t, -1), sin.view(t, -1))
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
        elif (
            whole
            and qkv.is_contiguous()
            and cpu_ops.rotary_(qkv, rope_heads, self.head_dim, *_rows_of(cos, sin, t))
        ):
            # one view of the heads split three ways: the views the column split below gives, in two calls
            q, k, v = qkv.view(t, rope_heads + self.num_kv_heads, self.head_dim).split_with_sizes(
                self._head_split, 1
            )
            return self._attend(q, k, v, t, cache, meta)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if whole and cpu_ops.rotary_(qkv, rope_heads, self.head_dim, cos.view(t, -1), sin.view(t, -1)):
                q = q.view(t, self.num_heads, self.head_dim)
                k = k.view(t, self.num_kv_heads, self.head_dim)
            else:
                q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
                k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self._attend(q, k, v, t, cache, meta)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        t: int,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        meta = meta.for_layer(self.sliding_window)
        out = self.backend.forward(q, k, v, cache, meta, self.scale, self.sliding_window)
        return all_reduce(self.o_proj.forward(out.reshape(t, self.q_size)))

    def _norm_qk_(self, qkv: torch.Tensor, t: int) -> None:
        """RMSNorm each q and k head of the fused projection in place, so the rotary paths read them there."""
        q = qkv[:, : self.q_size].reshape(t * self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t * self.num_kv_heads, self.head_dim)
        qkv[:, : self.q_size].copy_(self.q_norm(q).view(t, self.q_size))
        qkv[:, self.q_size : self.q_size + self.kv_size].copy_(self.k_norm(k).view(t, self.kv_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, dtype, device):
        super().__init__()
        triton = uses_triton_kernels(backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, triton)
        self.self_attn = Attention(config, layer, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, triton
        )
        if config.layer_is_sparse(layer):  # mixture of experts (Qwen3-MoE, Mixtral)
            if config.quantization is not None:
                raise UnsupportedModelError(
                    f"a quantized ({config.quantization.label}) mixture-of-experts checkpoint is not supported; "
                    "quantized checkpoints of dense models are"
                )
            self.mlp = SparseMoE(config, dtype, device, triton)
        else:
            self.mlp = SiluMLP(
                config.hidden_size,
                config.intermediate_size,
                config.mlp_bias,
                dtype,
                device,
                triton,
                config.quantization,
                f"model.layers.{layer}.mlp",
            )
        self.residual_multiplier = config.residual_multiplier  # Granite: blocks' outputs scaled before adding

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it): each residual add is fused into the norm after it, so
        the caller adds the last layer's output in the final norm."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward(h, cos, sin, cache, meta)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        h = self.mlp.forward(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        return h, residual


class LlamaForCausalLM(nn.Module):
    """`model(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]`; `compute_logits` -> float32.

    ``max_model_len``: the longest sequence the engine will run, where it is known when the model is built
    (it chooses LongRoPE's factor set, see layers.longrope_uses_long; None: the config's length)."""

    decoder_layer: type[nn.Module] = DecoderLayer  # a family of another block shape names its own (Gemma)

    def layer_backend(self, backend: AttentionBackend) -> AttentionBackend:
        """The backend the layers' attention calls (a family may wrap it, e.g. to soft-cap every call)."""
        return backend

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_model_len: int | None = None,
    ):
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device or "cpu")
        self.config = config
        self.backend = backend
        self.dtype = dtype
        # Pipeline parallelism: this stage's layers (the others are empty placeholders, so layer indices
        # stay the checkpoint's), the embedding on the first stage, the LM head on the last.
        pp = pp_state()
        self.stage_layers = pp.layers or (0, config.num_hidden_layers)
        keep_embedding = pp.first or (pp.last and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)
            if keep_embedding
            else None
        )
        self.vocab_start, self.vocab_end = shard_range(config.vocab_size)
        layer_backend = self.layer_backend(backend)
        lo, hi = self.stage_layers
        self.layers = nn.ModuleList(
            self.decoder_layer(config, i, layer_backend, dtype, device) if lo <= i < hi else nn.Identity()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, uses_triton_kernels(backend)
        )
        for module in self.modules():  # quantized linears run the GPU kernels on the Triton path
            if hasattr(module, "load_part"):
                module.triton = uses_triton_kernels(backend)
        if not pp.last:
            self.lm_head_weight = None
        elif config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            rows = self.vocab_end - self.vocab_start
            self.lm_head_weight = nn.Parameter(
                torch.empty(rows, config.hidden_size, dtype=dtype, device=device), False
            )
        self._lm_head_packed = cpu_linear.PackedWeight()
        # --quantization gguf: the LM head over the GGUF file's own blocks (engine/loader/gguf_quant.py)
        self.lm_head_quantized: nn.Module | None = None
        self.set_max_model_len(max_model_len, device)

    def set_max_model_len(self, max_model_len: int | None, device: torch.device | None = None) -> None:
        """(Re)build the rotary table for an engine whose sequences reach ``max_model_len`` tokens: LongRoPE
        picks its factors by it once, for every sequence (the other scalings do not depend on it)."""
        c = self.config
        self.rotary = RotaryEmbedding(
            rotary_dim(c.head_dim, c.partial_rotary_factor),
            c.rope_theta,
            c.rope_scaling,
            c.max_position_embeddings,
            device if device is not None else self.rotary.inv_freq.device,
            max_model_len,
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
        cpu_linear.refresh()  # the environment's switches for this step's linears, read once
        x = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        top = meta.max_seq_len if meta.max_position is None else meta.max_position
        cos, sin = self.rotary.cos_sin(positions, top, x.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, cos, sin, cache, meta)
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (only the rows that need sampling) -> float32 logits [N, vocab] (every tensor-parallel
        rank computes its vocabulary slice; the slices are gathered)."""
        cpu_linear.refresh()  # (also for families with a forward of their own: the next step sees the switches)
        if hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16:
            # bfloat16 logits lie 0.125 apart around 20, coarse enough to tie greedy's top two (the default
            # model's "capital of France" answer changed on such a tie): on the CPU the head runs in float32
            # over the bfloat16 weights (exact products), as the sampler wants float32 anyway.
            hidden = hidden.float()
        if self.lm_head_quantized is not None:
            local = self.lm_head_quantized(hidden).float()
        else:
            local = cpu_linear.step_linear(hidden, self.lm_head_weight, None, self._lm_head_packed).float()
        return finish_logits(all_gather_last_dim(local, shard_widths(self.config.vocab_size)), self.config)

    # ---- weights ------------------------------------------------------------------------------------

    def _target(self, name: str) -> tuple[torch.Tensor, int, int, tuple[int, list[int]] | None] | None:
        """Map a Hugging Face tensor name to (our parameter, row offset, rows, this rank's part of the
        checkpoint tensor as (dim, indices) or None for all of it); None = ignore the tensor. A sparse
        layer's expert and router tensors map to (its SparseMoE, the name within its block, 0, None)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            return None
        vocab_rows = self.vocab_end - self.vocab_start
        vocab_slice = (0, list(range(self.vocab_start, self.vocab_end)))
        if name == "lm_head.weight":
            return None if self.lm_head_weight is None else (self.lm_head_weight, 0, vocab_rows, vocab_slice)
        if name == "embed_tokens.weight":
            return (
                None if self.embed_tokens is None else (self.embed_tokens.weight, 0, vocab_rows, vocab_slice)
            )
        if name == "norm.weight":
            return (self.norm.weight, 0, self.config.hidden_size, None)
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 4:
            raise KeyError(name)
        if not self.stage_layers[0] <= int(parts[1]) < self.stage_layers[1]:
            return None  # another pipeline stage's layer
        layer = self.layers[int(parts[1])]
        sub = ".".join(parts[2:])
        attn, mlp, c = layer.self_attn, layer.mlp, self.config
        if isinstance(mlp, SparseMoE) and sub.startswith(MOE_PREFIXES):
            return (mlp, sub.split(".", 1)[1], 0, None)  # load_weights hands it to the experts
        q, kv, inter, hd = attn.q_size, attn.kv_size, mlp.intermediate, attn.head_dim
        q_idx = list(range(attn.q_heads[0] * hd, attn.q_heads[1] * hd))
        kv_idx = [h * hd + i for h in attn.kv_head_ids for i in range(hd)]
        inter_lo, inter_hi = shard_range(c.intermediate_size)
        inter_idx = list(range(inter_lo, inter_hi))
        q_rows, kv_rows, inter_rows = (0, q_idx), (0, kv_idx), (0, inter_idx)
        if sub in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return (getattr(layer, sub.split(".")[0]).weight, 0, c.hidden_size, None)
        if sub in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and attn.q_norm is not None:
            return (getattr(attn, sub.split(".")[1]).weight, 0, hd, None)
        module_name, _, kind = sub.rpartition(".")
        # module -> (ours, row offset, rows, slice of the weight, slice of the bias)
        table = {
            "self_attn.q_proj": (attn.qkv_proj, 0, q, q_rows, q_rows),
            "self_attn.k_proj": (attn.qkv_proj, q, kv, kv_rows, kv_rows),
            "self_attn.v_proj": (attn.qkv_proj, q + kv, kv, kv_rows, kv_rows),
            "self_attn.o_proj": (attn.o_proj, 0, c.hidden_size, (1, q_idx), None),
        }
        if not isinstance(mlp, SparseMoE):
            table |= {
                "mlp.gate_proj": (mlp.gate_up_proj, 0, inter, inter_rows, inter_rows),
                "mlp.up_proj": (mlp.gate_up_proj, inter, inter, inter_rows, inter_rows),
                "mlp.down_proj": (mlp.down_proj, 0, c.hidden_size, (1, inter_idx), None),
            }
        if module_name not in table:
            raise KeyError(name)
        module, offset, rows, weight_slice, bias_slice = table[module_name]
        if kind in getattr(module, "kinds", ()) and getattr(module, kind) is not None:
            # a quantized linear's tensor: the linear places (and slices) its canonical tensors itself
            return (module, kind, offset, rows, bias_slice if kind == "bias" else weight_slice)
        if kind not in ("weight", "bias"):
            raise KeyError(name)
        param = getattr(module, kind)
        if param is None:
            # A row-parallel layer's bias is added once, on rank 0; the other ranks skip it.
            if kind == "bias" and module_name in ("self_attn.o_proj", "mlp.down_proj") and tp_rank() > 0:
                return None
            raise KeyError(name)
        return (param, offset, rows, weight_slice if kind == "weight" else bias_slice)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused, maybe tensor-parallel sharded) parameters;
        every parameter must be set."""
        loaded: dict[int, int] = {}  # id(param) -> rows written
        if self.config.family.fused_checkpoint:
            weights = self._split_fused(weights)
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
            if isinstance(target[0], SparseMoE):  # the experts place (and shard) their own tensors
                try:
                    param, rows = target[0].load(target[1], tensor, name)
                except KeyError:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in a {self.config.architecture} model"
                    ) from None
                loaded[id(param)] = loaded.get(id(param), 0) + rows
                continue
            if len(target) == 5:  # a quantized linear's tensor
                module, kind, offset, rows, part = target
                written = module.load_part(kind, tensor, offset, rows, part if tp_size() > 1 else None)
                loaded[id(getattr(module, kind))] = loaded.get(id(getattr(module, kind)), 0) + written
                continue
            param, offset, rows, part = target
            if part is not None and tp_size() > 1:
                dim, indices = part
                if indices and tensor.shape[dim] <= indices[-1]:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, too small for this "
                        f"rank's part of dimension {dim}"
                    )
                tensor = tensor.index_select(dim, torch.tensor(indices, dtype=torch.long))
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
        for module in self.modules():  # act-order INT4 checkpoints: columns sorted by group
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        dequantize_linears(self)  # on the CPU, FP8 / INT4 linears run dense over weights dequantized once

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Phi-3's fused `qkv_proj` and `gate_up_proj` tensors as their q/k/v and gate/up parts, which then
        load (and shard over tensor-parallel ranks) as any other checkpoint's."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        fused = {
            "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
            "mlp.gate_up_proj": (("gate_proj", "up_proj"), [c.intermediate_size] * 2),
        }
        for name, tensor in weights:
            stem, _, kind = name.rpartition(".")
            prefix, _, module = stem.rpartition(".")
            prefix, _, block = prefix.rpartition(".")
            parts = fused.get(f"{block}.{module}")
            if parts is None:
                yield name, tensor
                continue
            names, sizes = parts
            if tensor.shape[0] != sum(sizes):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {sum(sizes)} rows "
                    f"({' + '.join(map(str, sizes))})"
                )
            for part, piece in zip(names, tensor.split(sizes), strict=True):
                yield f"{prefix}.{block}.{part}.{kind}", piece
