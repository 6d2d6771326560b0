"""Tiny quantized checkpoints built here, in each format the engine loads (issue 37), with the float weights
they dequantize to.

The packing follows each format's published layout, written from the formats' descriptions (never their
code):
- GPTQ: ``qweight`` int32 [K / 8, N], input row 8r + i in bits 4i..4i+3 of word (r, n); ``qzeros`` int32
  [K / g, N / 8], output column 8c + i in bits 4i of word (g, c), stored as zero - 1 in the original format
  (checkpoint_format "gptq"), as is in "gptq_v2"; ``scales`` [K / g, N] float16; ``g_idx`` int32 [K].
- AWQ (GEMM): ``qweight`` int32 [K, N / 8] and ``qzeros`` [K / g, N / 8], output column 8c + ORDER[i] in bits
  4i with ORDER = 0, 2, 4, 6, 1, 3, 5, 7; ``scales`` [K / g, N] float16.
- compressed-tensors pack-quantized: signed 4-bit values stored + 8, ``weight_packed`` int32 [N, K / 8]
  (column 8c + i in bits 4i), ``weight_zero_point`` int32 [N / 8, K / g] packed along the rows (asymmetric
  only), ``weight_scale`` [N, K / g], ``weight_shape`` [2]; tests check this packing against the
  compressed-tensors library's own.
- FP8: ``weight`` float8_e4m3fn [N, K] with ``weight_scale`` (compressed-tensors: [1] per tensor, [N, 1] per
  channel, [ceil(N / 128), ceil(K / 128)] per block) or ``weight_scale_inv`` (quant_method fp8 with
  weight_block_size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0

# format name -> (quantization_config, how the weights are quantized)
FORMATS: dict[str, dict] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "gptq-asym-v2": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },
    "gptq-channel": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True},
    # act-order: groups formed over a permutation of the input columns (the same for linears sharing an input)
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "ct-int4-sym": {
        "ct": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    },
    "ct-int4-asym": {
        "ct": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}
    },
    "ct-int4-channel": {"ct": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}},
    "ct-fp8-tensor": {"ct": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}},
    "ct-fp8-channel": {"ct": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}},
    "ct-fp8-block": {
        "ct": {
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [128, 128],
            "symmetric": True,
        }
    },
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def quantization_config(fmt: str) -> dict:
    spec = FORMATS[fmt]
    if "ct" not in spec:
        return dict(spec)
    weights = spec["ct"]
    fp8 = weights["type"] == "float"
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if fp8 else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "dynamic": False},
                "input_activations": acts if fp8 else None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


# ---- quantizers (round to nearest) ----------------------------------------------------------------------


def quantize_int4(
    w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] 0..15, scales [N, G] in scale_dtype, zeros uint8 [N, G]) of a float weight."""
    n, k = w.shape
    g = k if group <= 0 else group
    wg = w.float().reshape(n, k // g, g)
    if symmetric:
        scale = (wg.abs().amax(dim=2) / 7).clamp(min=1e-8).to(scale_dtype)
        zero = torch.full_like(scale, 8, dtype=torch.float32)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype)
        zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (wg / scale.float().unsqueeze(2)).round() + zero.unsqueeze(2)
    return q.clamp(0, 15).reshape(n, k).to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] = (q - zero) * scale per group (the formats' shared definition)."""
    g = q.shape[1] // scales.shape[1]
    z = zeros.float().repeat_interleave(g, dim=1)
    return (q.float() - z) * scales.float().repeat_interleave(g, dim=1)


def quantize_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 scale: [1] tensor, [N, 1] channel, [ceil(N / 128), ceil(K / 128)]
    block)."""
    w = w.float()
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand(n, k)
    else:  # partial blocks at the ends (llm-compressor's ceil-sized grid): amax over the rows they have
        nb, kb = -(-n // 128), -(-k // 128)
        padded = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n))
        scale = padded.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    block = scale.dim() == 2 and (scale.shape[1] > 1 or scale.shape[0] != n)
    if block:  # 128 x 128, the last ones maybe partial
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        full = scale.reshape(-1, 1)
    return q.float() * full


# ---- packers --------------------------------------------------------------------------------------------


def words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...] with value i in bits 4i..4i+3 (two's complement)."""
    v = sum(nibbles[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_gptq(
    q, scales, zeros, group: int, v1: bool, g_idx: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    n, k = q.shape
    qt = q.T.reshape(k // 8, 8, n).permute(0, 2, 1)  # [K/8, N, 8]: input rows 8r..8r+7
    stored = ((zeros.T.to(torch.int16) - (1 if v1 else 0)) & 0xF).reshape(zeros.shape[1], n // 8, 8)
    g = k if group <= 0 else group
    return {
        "qweight": words(qt),
        "qzeros": words(stored),
        "scales": scales.T.contiguous().to(torch.float16),
        "g_idx": (torch.arange(k) // g if g_idx is None else g_idx).to(torch.int32),
    }


def act_order(k: int) -> torch.Tensor:
    """The column order an act-order quantizer went in (seeded by K, so linears sharing an input share it)."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(k))


def quantize_int4_act_order(w: torch.Tensor, group: int, symmetric: bool):
    """(q, scales, zeros, g_idx): groups of ``group`` columns taken in `act_order`; q in the original order."""
    perm = act_order(w.shape[1])
    qp, s, z = quantize_int4(w[:, perm], group, symmetric, torch.float16)
    q = torch.empty_like(qp)
    q[:, perm] = qp
    g_idx = torch.empty(w.shape[1], dtype=torch.int64)
    g_idx[perm] = torch.arange(w.shape[1]) // group
    return q, s, z, g_idx


def pack_awq(q, scales, zeros) -> dict[str, torch.Tensor]:
    n, k = q.shape
    order = list(AWQ_ORDER)
    qt = q.T.reshape(k, n // 8, 8)[..., order]
    zt = zeros.T.reshape(zeros.shape[1], n // 8, 8)[..., order]
    return {"qweight": words(qt), "qzeros": words(zt), "scales": scales.T.contiguous().to(torch.float16)}


def pack_ct_int4(q, scales, zeros, symmetric: bool) -> dict[str, torch.Tensor]:
    n, k = q.shape
    out = {
        "weight_packed": words(q.reshape(n, k // 8, 8)),
        "weight_scale": scales,
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = words(zeros.T.reshape(zeros.shape[1], n // 8, 8)).T.contiguous()
    return out


# ---- checkpoints ----------------------------------------------------------------------------------------


def quantize_module(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint tensors of one linear, keyed by their suffix, the float32 weight they stand for)."""
    spec = FORMATS[fmt]
    if "ct" in spec:
        ws = spec["ct"]
        if ws["type"] == "float":
            q, scale = quantize_fp8(w, ws["strategy"])
            return {"weight": q, "weight_scale": scale}, dequantize_fp8(q, scale)
        group = ws.get("group_size", -1) if ws["strategy"] == "group" else -1
        q, s, z = quantize_int4(w, group, ws["symmetric"], torch.bfloat16)
        return pack_ct_int4(q, s, z, ws["symmetric"]), dequantize_int4(q, s, z)
    method = spec["quant_method"]
    if method == "fp8":
        strategy = "block" if spec.get("weight_block_size") else "tensor"
        q, scale = quantize_fp8(w, strategy)
        name = "weight_scale_inv" if strategy == "block" else "weight_scale"
        return {"weight": q, name: scale if strategy == "block" else scale.reshape(())}, dequantize_fp8(
            q, scale
        )
    group = spec["group_size"]
    symmetric = spec.get("sym", True)
    if method == "awq":
        q, s, z = quantize_int4(w, group, False, torch.float16)
        return pack_awq(q, s, z), dequantize_int4(q, s, z)
    v1 = spec.get("checkpoint_format", "gptq") == "gptq"
    if spec.get("desc_act"):
        q, s, z, g_idx = quantize_int4_act_order(w, group, symmetric)
        reference = (q.float() - z.float()[:, g_idx]) * s.float()[:, g_idx]
        return pack_gptq(q, s, z, group, v1, g_idx), reference
    q, s, z = quantize_int4(w, group, symmetric, torch.float16)
    return pack_gptq(q, s, z, group, v1), dequantize_int4(q, s, z)


def save_quantized(hf_model: torch.nn.Module, path: str | Path, fmt: str) -> None:
    """Write ``hf_model`` (config and weights, save_pretrained) to ``path`` as a checkpoint quantized in
    ``fmt``, and set the model's own linears to the dequantized weights, so it is the float reference."""
    path = Path(path)
    hf_model.save_pretrained(path, safe_serialization=True)
    for f in path.glob("*.safetensors"):
        f.unlink()
    tensors: dict[str, torch.Tensor] = {}
    state = hf_model.state_dict()
    tied = getattr(hf_model.config, "tie_word_embeddings", False)
    with torch.no_grad():
        for name, t in state.items():
            stem, _, kind = name.rpartition(".")
            if name == "lm_head.weight" and tied:
                continue
            if stem.rpartition(".")[2] in LINEARS and kind == "weight":
                parts, deq = quantize_module(fmt, t)
                tensors |= {f"{stem}.{k}": v.contiguous() for k, v in parts.items()}
                t.copy_(deq.to(t.dtype))  # the reference runs the dequantized weight
                continue
            tensors[name] = t.detach().clone().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (path / "config.json").write_text(json.dumps(config, indent=2))
