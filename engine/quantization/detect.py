"""Which quantization a checkpoint's config.json declares (`quantization_config`), as a QuantScheme, or a
refusal that names what is supported.

Pure Python (no torch, nothing else of the engine): engine/sizing reads it for the engine and the planner
alike, and turns the refusal into its UnsupportedModelError.

Supported (the engine loads and runs these; docs/models.md "Quantized checkpoints"):
- compressed-tensors FP8 weights (float 8-bit, per-tensor, per-channel or 128x128 blocks), activations dynamic
  per token or static (the engine quantizes activations per token at run time either way);
- compressed-tensors pack-quantized INT4 weights (group or per-channel, symmetric or asymmetric), activations
  unquantized;
- plain "fp8" (vLLM / transformers' FP8: per-tensor or `weight_block_size` blocks);
- GPTQ 4-bit (any group size or -1, sym or asym, desc_act too: an act-order g_idx is sorted at load) and AWQ
  4-bit GEMM (with zero points).
"""

from __future__ import annotations

from typing import Any

from pagoda.engine.quantization.scheme import QuantScheme

SUPPORTED = (
    "compressed-tensors FP8 (per-tensor, per-channel, 128x128 block weights; per-token dynamic or static "
    "activations) and pack-quantized INT4 weight-only (group/channel, symmetric/asymmetric); GPTQ 4-bit; "
    "AWQ 4-bit GEMM with zero points; fp8 (quant_method 'fp8', per-tensor or weight_block_size blocks); "
    "GGUF files (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K ...)"
)


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization is one the engine does not run (engine/sizing re-raises it as an
    UnsupportedModelError with the same message)."""


def detect_quantization(config_json: dict[str, Any], where: str = "config.json") -> QuantScheme | None:
    """The scheme of config.json's quantization_config (None: an unquantized checkpoint)."""
    quant = config_json.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        _refuse(where, "an unreadable", f"quantization_config is {type(quant).__name__}, not an object")
    method = str(quant.get("quant_method") or "unknown").lower()
    reader = _READERS.get(method)
    if reader is None:
        _refuse(where, repr(method), "this quantization method is not supported")
    return reader(quant, where)


def _refuse(where: str, method: str, why: str) -> None:
    raise UnsupportedQuantizationError(
        f"{where}: a {method}-quantized checkpoint (quantization_config) is not supported: {why}. Pagoda runs "
        f"{SUPPORTED}; or use the unquantized checkpoint"
    )


def _names(value: Any) -> tuple[str, ...]:
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def _gptq(q: dict[str, Any], where: str) -> QuantScheme:
    bits = int(q.get("bits", 4))
    if bits != 4:
        _refuse(where, "'gptq'", f"{bits}-bit GPTQ (only 4-bit is)")
    group = int(q.get("group_size", 128))
    fmt = str(q.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(where, "'gptq'", f"checkpoint_format {fmt!r} (gptq and gptq_v2 are)")
    pack = str(q.get("pack_dtype") or "int32").lower().removeprefix("torch.")
    if pack != "int32":
        _refuse(where, "'gptq'", f"pack_dtype {pack!r} (int32 words are)")
    if q.get("is_marlin_format") or q.get("use_exllama_v2_format"):
        _refuse(where, "'gptq'", "a Marlin-repacked GPTQ checkpoint")
    ignore = ()
    if not q.get("lm_head", False):
        ignore = ("lm_head",)
    return QuantScheme(
        format="int4",
        source="gptq",
        group_size=group,
        symmetric=bool(q.get("sym", True)),
        ignore=ignore + _names(q.get("modules_to_not_convert")),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq(q: dict[str, Any], where: str) -> QuantScheme:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        _refuse(where, "'awq'", f"{bits}-bit AWQ (only 4-bit is)")
    version = str(q.get("version") or "gemm").lower()
    if version != "gemm":
        _refuse(where, "'awq'", f"AWQ version {version!r} (its GEMM layout is)")
    if not q.get("zero_point", True):
        _refuse(where, "'awq'", "AWQ without zero points (zero_point: false)")
    # AutoAWQ skips any module whose name contains one of these.
    skip = tuple(f"re:.*{m}.*" for m in _names(q.get("modules_to_not_convert")))
    return QuantScheme(
        format="int4",
        source="awq",
        group_size=int(q.get("group_size", q.get("q_group_size", 128))),
        symmetric=False,
        ignore=("lm_head",) + skip,
    )


def _fp8(q: dict[str, Any], where: str) -> QuantScheme:
    fmt = str(q.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        _refuse(where, "'fp8'", f"FP8 format {fmt!r} (e4m3 is)")
    acts = str(q.get("activation_scheme") or "dynamic").lower()
    block = q.get("weight_block_size")
    ignore = ("lm_head",) + _names(q.get("ignored_layers")) + _names(q.get("modules_to_not_convert"))
    if block:
        if len(block) != 2:
            _refuse(where, "'fp8'", f"weight_block_size {block!r} (two sizes are expected)")
        if acts != "dynamic":
            _refuse(where, "'fp8'", "block-wise FP8 with static activation scales")
        return QuantScheme("fp8", "fp8", int(block[1]), (int(block[0]), int(block[1])), True, True, ignore)
    return QuantScheme("fp8", "fp8", 0, None, True, acts == "dynamic", ignore)


def _compressed_tensors(q: dict[str, Any], where: str) -> QuantScheme:
    method = "'compressed-tensors'"
    groups = q.get("config_groups") or {}
    if not groups:
        _refuse(where, method, "no config_groups")
    schemes = set()
    for name, group in groups.items():
        schemes.add(_ct_group(group, q.get("format"), f"config_groups.{name}", where))
    if len(schemes) > 1:
        _refuse(where, method, "config_groups with different schemes in one checkpoint")
    scheme = schemes.pop()
    if q.get("sparsity_config"):
        _refuse(where, method, "a sparse (2:4 ...) compressed-tensors checkpoint")
    status = str(q.get("quantization_status") or "compressed").lower()
    if status != "compressed":
        _refuse(where, method, f"quantization_status {status!r} (a compressed checkpoint is)")
    return QuantScheme(
        scheme.format,
        scheme.source,
        scheme.group_size,
        scheme.block,
        scheme.symmetric,
        scheme.act_dynamic,
        _names(q.get("ignore")),
    )


def _ct_group(group: dict[str, Any], default_format: Any, field: str, where: str) -> QuantScheme:
    method = "'compressed-tensors'"
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = str(group.get("format") or default_format or "").lower()
    targets = _names(group.get("targets"))
    if targets and not any(t == "Linear" or t.startswith("re:") for t in targets):
        _refuse(where, method, f"{field} targets {list(targets)} (Linear layers are)")
    if group.get("output_activations"):
        _refuse(where, method, f"{field} quantizes output activations")
    bits, kind = int(weights.get("num_bits", 0)), str(weights.get("type", "int")).lower()
    strategy = str(weights.get("strategy") or "tensor").lower()
    if weights.get("dynamic"):
        _refuse(where, method, f"{field} has dynamic weight scales")
    if kind == "float" and bits == 8:
        if fmt not in ("float-quantized", "naive-quantized", ""):
            _refuse(where, method, f"{field}: FP8 weights stored as {fmt!r} (float-quantized is)")
        if not weights.get("symmetric", True):
            _refuse(where, method, f"{field}: asymmetric FP8 weights")
        act_dynamic = True
        if acts:
            a_bits, a_kind = int(acts.get("num_bits", 0)), str(acts.get("type", "int")).lower()
            a_strategy = str(acts.get("strategy") or "tensor").lower()
            if (a_bits, a_kind) != (8, "float") or a_strategy not in ("token", "tensor", "group"):
                _refuse(
                    where, method, f"{field}: {a_bits}-bit {a_kind} {a_strategy} activations with FP8 weights"
                )
            act_dynamic = bool(acts.get("dynamic", True))
        if strategy == "tensor":
            return QuantScheme("fp8", "compressed-tensors", 0, None, True, act_dynamic)
        if strategy == "channel":
            return QuantScheme("fp8", "compressed-tensors", -1, None, True, act_dynamic)
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            if isinstance(block, str):  # older configs wrote "128x128"
                block = [int(x) for x in block.lower().split("x")]
            rows, cols = int(block[0]), int(block[1])
            return QuantScheme("fp8", "compressed-tensors", cols, (rows, cols), True, act_dynamic)
        _refuse(
            where, method, f"{field}: FP8 weights with strategy {strategy!r} (tensor, channel, block are)"
        )
    if kind == "int" and bits == 4:
        if acts:
            _refuse(where, method, f"{field}: INT4 weights with quantized activations (W4A8)")
        if fmt not in ("pack-quantized", ""):
            _refuse(where, method, f"{field}: INT4 weights stored as {fmt!r} (pack-quantized is)")
        if strategy == "group":
            size = int(weights.get("group_size") or 0)
            if size <= 0:
                _refuse(where, method, f"{field}: group strategy without a group_size")
        elif strategy == "channel":
            size = -1
        else:
            _refuse(where, method, f"{field}: INT4 weights with strategy {strategy!r} (group, channel are)")
        return QuantScheme("int4", "compressed-tensors", size, None, bool(weights.get("symmetric", True)))
    what = f"{bits}-bit {kind} weights" + (" with quantized activations (W8A8)" if acts else "")
    _refuse(where, method, f"{field}: {what} (8-bit float and 4-bit int weights are)")
    raise AssertionError  # unreachable: _refuse raises


_READERS = {
    "gptq": _gptq,
    "awq": _awq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}
