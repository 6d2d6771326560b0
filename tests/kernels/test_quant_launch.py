"""The quantized linears' launch configurations and warm units: every catalogue GPU's tiles fit its shared
memory, the row tile follows the step's rows, and only a quantized plan launches the quantized kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from pagoda.engine.sizing import GPU_CATALOGUE
from pagoda.kernels.launch_config import (
    INTERPRETER,
    QUANT_KINDS,
    DeviceLimits,
    fp8_act_quant_config,
    quant_linear_config,
    quant_rows_bucket,
)
from pagoda.kernels.warm import KernelPlan, quantized_linears


@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_every_catalogue_gpu_gets_quantized_tiles_that_fit(spec):
    device = DeviceLimits(spec.compute_capability, spec.shared_memory_per_block)
    for kind in QUANT_KINDS:
        for dtype in ("float16", "bfloat16", "float32"):
            for m in (1, 16, 17, 64, 65, 4096):
                c = quant_linear_config(device, dtype, kind, m)
                assert c.shared_memory <= spec.shared_memory_per_block
                assert c.block_m == quant_rows_bucket(m) and c.block_n >= 16 and c.block_k >= 16
                assert c.num_stages == (3 if spec.compute_capability >= (8, 0) else 2)


def test_rows_pick_the_tile_and_the_interpreter_the_least():
    assert [quant_rows_bucket(m) for m in (1, 16, 17, 32, 33, 64, 65, 8192)] == [
        16,
        16,
        32,
        32,
        64,
        64,
        128,
        128,
    ]
    h100 = DeviceLimits((9, 0), 227 * 1024)
    decode = quant_linear_config(h100, "bfloat16", "w4a16", 1)
    assert (decode.block_m, decode.block_n, decode.block_k) == (16, 32, 256)  # long K steps, narrow tiles
    prefill = quant_linear_config(h100, "bfloat16", "fp8", 2048)
    assert (prefill.block_m, prefill.block_n, prefill.block_k, prefill.num_warps) == (128, 128, 64, 8)
    assert quant_linear_config(INTERPRETER, "float32", "fp8", 500).block_m == 16
    small = quant_linear_config(DeviceLimits((7, 5), 20 * 1024), "float16", "w4a16", 2048)
    assert small.shared_memory <= 20 * 1024
    with pytest.raises(ValueError, match="no w4a16 tile fits"):
        quant_linear_config(DeviceLimits((7, 5), 1024), "float16", "w4a16", 1)
    with pytest.raises(ValueError, match="kind must be"):
        quant_linear_config(h100, "float16", "int8", 1)


def test_the_activation_quantizer_steps_through_a_group_at_most_1024_columns_at_a_time():
    h100 = DeviceLimits((9, 0), 227 * 1024)
    assert [fp8_act_quant_config(h100, g).block for g in (128, 576, 4096, 14336, 1)] == [
        128,
        1024,
        1024,
        1024,
        16,
    ]
    assert fp8_act_quant_config(INTERPRETER, 4096).block == 32


def _plan(cc, quant_format, ranks=((32, 8),)):
    return KernelPlan(cc, 100 * 1024, ranks, 128, 4096, 14336, 16, "bfloat16", "bfloat16",
                      attention=False, quant_format=quant_format)  # fmt: skip


RECORD = textwrap.dedent(
    """
    import json
    from pagoda.kernels.aot import recording_for
    from pagoda.kernels.warm import KernelPlan, launch_plan

    report = {}
    for cc, fmt in (((9, 0), ""), ((9, 0), "gguf"), ((8, 0), "int4"), ((8, 9), "fp8"), ((8, 0), "fp8")):
        plan = KernelPlan(cc, 100 * 1024, ((32, 8),), 128, 4096, 14336, 16, "bfloat16", "bfloat16",
                          attention=False, quant_format=fmt)
        with recording_for(plan.limits) as keys:
            launch_plan(plan)
        report[f"{cc[0]}.{cc[1]} {fmt}"] = [sorted({k[0] for k in keys}), len(keys)]
    print(json.dumps(report))
    """
)


def test_only_a_quantized_plan_launches_the_quantized_kernels():
    """Recorded (not compiled) in a process of its own: this session's Triton is the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", RECORD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["9.0 "] == [[], 0] and report["9.0 gguf"] == [[], 0]  # GGUF runs dequantized on a GPU
    kernels, variants = report["8.0 int4"]
    assert kernels == ["_w4a16_kernel"] and variants >= 4  # a variant per row bucket at least
    assert report["8.9 fp8"][0] == ["_fp8_linear_kernel", "_quantize_fp8_kernel"]  # activations quantized
    assert report["8.0 fp8"][0] == ["_fp8_linear_kernel"]  # weight-only


def test_quantized_linears_follow_the_ranks():
    tp1 = quantized_linears(_plan((9, 0), "int4"))
    assert tp1 == [(4096, 6144, False), (4096, 6144, True), (4096, 4096, False), (4096, 28672, False),
                   (14336, 4096, False)]  # fmt: skip
    tp4 = quantized_linears(_plan((9, 0), "int4", ranks=((8, 2),)))
    assert [(k, n) for k, n, bias in tp4 if not bias] == [
        (4096, 1536),
        (1024, 4096),
        (4096, 7168),
        (3584, 4096),
    ]


def test_the_warm_cli_passes_the_checkpoint_s_format():
    from pagoda.engine.cli.kernels import kernel_plan

    common = dict(
        num_attention_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336,
        sliding_window=None, compute_capability=(9, 0), shared_memory_per_block=232448, dtype="bfloat16",
        kv_cache_dtype="bfloat16", tensor_parallel_size=1, block_size=16, lora_rank=None,
    )  # fmt: skip
    assert kernel_plan(**common).quant_format == ""
    assert kernel_plan(**common, quant_format="fp8").quant_format == "fp8"
    assert kernel_plan(**common, quant_format="gguf").quant_format == ""
    assert torch.float8_e4m3fn  # the plan's FP8 kernels need torch's FP8 dtype


def test_a_quantized_checkpoint_s_plan_names_its_format():
    """`pagoda kernels warm --model <id>`: the shape's weight format (read from the checkpoint's
    quantization_config, here the catalogue's published quantized ids) decides the quantized units."""
    from pagoda.engine.cli.kernels import _parser, plan_unit
    from pagoda.engine.cli.plan import resolve_shape
    from pagoda.engine.sizing import lookup_gpu

    args = _parser().parse_args(["warm", "--gpu", "L4"])
    got = {
        model: plan_unit(lookup_gpu("L4"), model, resolve_shape(model), args).plan.quant_format
        for model in ("Qwen/Qwen3-8B-AWQ", "Qwen/Qwen3-8B-FP8", "Qwen/Qwen3-8B")
    }
    assert got == {"Qwen/Qwen3-8B-AWQ": "int4", "Qwen/Qwen3-8B-FP8": "fp8", "Qwen/Qwen3-8B": ""}


SERVE_EQUALS_WARM = textwrap.dedent(
    """
    import json
    import torch
    from pagoda.engine.quantization.linear import quantized_linear
    from pagoda.engine.quantization.scheme import QuantScheme
    from pagoda.kernels.aot import recording_for
    from pagoda.kernels.warm import KernelPlan, launch_plan

    META = torch.device("meta")
    SCHEMES = {
        "int4": [QuantScheme("int4", "awq", 128, symmetric=False), QuantScheme("int4", "gptq", -1)],
        "fp8": [QuantScheme("fp8", "compressed-tensors", 0), QuantScheme("fp8", "compressed-tensors", -1),
                QuantScheme("fp8", "compressed-tensors", 128, block=(128, 128))],
    }
    report = {}
    for cc in ((9, 0), (8, 0)):
        for fmt, schemes in SCHEMES.items():
            for bias in (False, True):  # Qwen2's qkv has one
                plan = KernelPlan(cc, 160 * 1024, ((32, 8),), 128, 4096, 14336, 16, "bfloat16", "bfloat16",
                                  attention=False, quant_format=fmt)
                with recording_for(plan.limits) as warmed:
                    launch_plan(plan)
                with recording_for(plan.limits) as served:
                    for scheme in schemes:
                        linears = [quantized_linear(4096, 6144, bias, torch.bfloat16, META, scheme),
                                   quantized_linear(4096, 4096, False, torch.bfloat16, META, scheme),
                                   quantized_linear(4096, 28672, False, torch.bfloat16, META, scheme),
                                   quantized_linear(14336, 4096, False, torch.bfloat16, META, scheme)]
                        if scheme.block:  # fused parts that cut its blocks: scales held per row
                            linears.append(quantized_linear(4096, 6144, bias, torch.bfloat16, META, scheme))
                            linears[-1]._hold_scales_per_row()
                        for layer in linears:
                            layer.triton = True
                            for tokens in (1, 3, 16, 17, 40, 64, 100, 512, 2048):
                                layer(torch.empty((tokens, layer.in_features), dtype=torch.bfloat16, device=META))
                report[f"{cc} {fmt} {bias}"] = [len(served), len(served - warmed)]
    print(json.dumps(report))
    """
)


def test_what_the_engine_s_quantized_linears_launch_is_warmed():
    """QF's Int4Linear / Fp8Linear (engine/quantization/linear.py) called as a model calls them, for every
    scheme of the format (block-wise FP8 also with its scales held per row), decode to prefill token counts, a
    biased qkv or not, on an H100 and an A100: every
    variant they launch (recorded, not compiled) is among those the warm of a plan with that format
    launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SERVE_EQUALS_WARM], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 8
    for case, (served, missing) in report.items():
        assert served >= 4 and missing == 0, (case, served, missing)
