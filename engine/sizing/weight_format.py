"""Weight bytes by checkpoint format: which linears a quantized checkpoint holds quantized, and their bytes.

A quantized checkpoint's bytes are not its parameters times a dtype: each quantized linear holds its packed
weights plus scales (and zero points), by the scheme (engine/quantization/scheme.py's weight_bits, the bits
the engine holds per weight, on a GPU), or by each GGUF tensor's ggml type. Embeddings, norms, biases, MoE
routers and the LM head stay in the compute dtype in FP8/INT4 checkpoints (no AWQ/GPTQ checkpoint quantizes the
LM head; compressed-tensors lists it in `ignore`), so a shape's weight bytes are its dense part in the compute
dtype plus the quantized linears' bytes. A GGUF under `--quantization gguf` also runs its LM head from the
file's blocks (output.weight, freeing the float head; or a tied model's token_embd blocks, beside the float
embedding its lookups read).

Where the engine holds them quantized (`held_quantized`): FP8 and INT4 on a GPU (Triton kernels); on the CPU
they are dequantized once after loading to the compute dtype and run dense, so they are sized as float. GGUF
blocks are held only on the CPU with `--quantization gguf` (vLLM's flag); without it, and on a GPU, the engine
dequantizes the whole file at load, as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.quantization.scheme import (
    FUSED_PARTS,
    QuantScheme,
    bits_per_weight_gguf,
    ignored,
    weight_bits,
)

# GGUF block types the CPU kernels run in their blocks (`--quantization gguf`); others are dequantized at load
GGUF_KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# llama.cpp's names of a decoder layer's linear weights (blk.N.<name>.weight), MoE experts' included
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # fmt: skip


@dataclass(frozen=True)
class WeightFormat:
    """A checkpoint's quantized linears as sizing counts them."""

    format: str  # "fp8" | "int4" | "gguf"
    label: str  # the format in words, for plans and refusals ("int4 (awq, group 128, asymmetric)")
    quantized_params: int  # weight elements of the linears held quantized
    quantized_bytes: int  # their bytes as the engine holds them, scales and zero points included
    # bytes held quantized beside the float parameters, which stay too: a GGUF's tied LM head, kept in the
    # token embedding's blocks while the embedding lookups read its float copy
    extra_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.quantized_bytes / self.quantized_params if self.quantized_params else 0.0


def held_quantized(fmt: str, device: str, quantization: str | None = None) -> bool:
    """Whether the engine holds a checkpoint of format `fmt` ("" for float) quantized on `device` ("cpu" or
    "cuda"), given serve's `--quantization` (None: detected from the checkpoint)."""
    if fmt == "gguf":
        return device == "cpu" and quantization == "gguf"
    return fmt in ("fp8", "int4") and device != "cpu"


@dataclass(frozen=True)
class Linear:
    """One kind of linear in the decoder: its module name, `count` of them, N output rows, K inputs."""

    name: str
    count: int
    rows: int
    cols: int


def decoder_linears(
    *,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    sparse_layers: int = 0,
    num_experts: int = 0,
    moe_intermediate_size: int = 0,
) -> list[Linear]:
    """The linears a quantized checkpoint may quantize (every decoder layer's projections and experts' MLPs;
    the router, embeddings and LM head are not among them), with the names scheme.ignored() reads."""
    q, kv = num_attention_heads * head_dim, num_kv_heads * head_dim
    dense = num_layers - sparse_layers
    out = [
        Linear("model.layers.0.self_attn.q_proj", num_layers, q, hidden_size),
        Linear("model.layers.0.self_attn.k_proj", num_layers, kv, hidden_size),
        Linear("model.layers.0.self_attn.v_proj", num_layers, kv, hidden_size),
        Linear("model.layers.0.self_attn.o_proj", num_layers, hidden_size, q),
    ]
    if dense:
        out += [
            Linear("model.layers.0.mlp.gate_proj", dense, intermediate_size, hidden_size),
            Linear("model.layers.0.mlp.up_proj", dense, intermediate_size, hidden_size),
            Linear("model.layers.0.mlp.down_proj", dense, hidden_size, intermediate_size),
        ]
    if sparse_layers and num_experts:
        n = sparse_layers * num_experts
        out += [
            Linear("model.layers.0.mlp.experts.0.gate_proj", n, moe_intermediate_size, hidden_size),
            Linear("model.layers.0.mlp.experts.0.up_proj", n, moe_intermediate_size, hidden_size),
            Linear("model.layers.0.mlp.experts.0.down_proj", n, hidden_size, moe_intermediate_size),
        ]
    return out


def scheme_format(scheme: QuantScheme, linears: list[Linear]) -> WeightFormat:
    """The quantized part of an FP8 / INT4 checkpoint: the linears its ignore list leaves quantized, at the
    scheme's bits per weight (scales and zero points included)."""
    params = nbytes = 0
    per_row = _blocks_cut_by_fusion(scheme, linears)
    for lin in linears:
        if ignored(scheme, lin.name):
            continue
        elements = lin.rows * lin.cols
        params += lin.count * elements
        if lin.name in per_row:  # one row of float32 block scales per weight row
            nbytes += lin.count * (elements + lin.rows * -(-lin.cols // scheme.block[1]) * 4)
        else:
            nbytes += lin.count * -(-int(elements * weight_bits(scheme, lin.cols)) // 8)
    return WeightFormat(scheme.format, scheme.label, params, nbytes)


def _blocks_cut_by_fusion(scheme: QuantScheme, linears: list[Linear]) -> set[str]:
    """Names of the block-wise FP8 linears whose fused linear holds its scales per row: one of its parts
    starts inside a block of rows (SmolLM2's k_proj at row 576 of q/k/v), as Fp8Linear decides at load."""
    if scheme.format != "fp8" or scheme.block is None:
        return set()
    bn = scheme.block[0]
    by_name = {lin.name: lin for lin in linears}
    cut: set[str] = set()
    for parts in FUSED_PARTS.values():
        for prefix in {lin.name.rsplit(".", 1)[0] for lin in linears if lin.name.endswith("." + parts[0])}:
            group = [by_name.get(f"{prefix}.{part}") for part in parts]
            if None in group or any(ignored(scheme, lin.name) for lin in group):
                continue
            starts = [sum(lin.rows for lin in group[:i]) for i in range(len(group))]
            if any(start % bn for start in starts):
                cut.update(lin.name for lin in group)
    return cut


def gguf_format(tensors: dict[str, tuple[int, ...]], types: dict[str, str]) -> WeightFormat | None:
    """The linears (and LM head) a GGUF file holds in blocks the CPU kernels run (GGUF_KEPT_TYPES), at their
    types' bytes; None when it has none (an F16/F32 file). The label counts the linear tensors of each type."""
    params = nbytes = 0
    seen: dict[str, int] = {}
    for name, dims in tensors.items():
        parts = name.split(".")
        kind = types.get(name, "")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LINEARS or parts[3] != "weight":
            continue
        if kind not in GGUF_KEPT_TYPES or len(dims) < 2:
            continue
        elements = 1
        for d in dims:
            elements *= d
        params += elements
        nbytes += int(elements * bits_per_weight_gguf(kind)) // 8
        seen[kind] = seen.get(kind, 0) + 1
    if not params:
        return None
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1]))
    extra, head = 0, "output.weight" if "output.weight" in tensors else "token_embd.weight"
    kind, dims = types.get(head, ""), tensors.get(head, ())
    if kind in GGUF_KEPT_TYPES and len(dims) == 2:
        head_bytes = int(dims[0] * dims[1] * bits_per_weight_gguf(kind)) // 8
        if head == "output.weight":
            params, nbytes = params + dims[0] * dims[1], nbytes + head_bytes
        else:
            extra = head_bytes
        kinds += f"; LM head {kind}" + (" (tied: beside the float embedding)" if extra else "")
    return WeightFormat("gguf", f"gguf ({kinds})", params, nbytes, extra)
