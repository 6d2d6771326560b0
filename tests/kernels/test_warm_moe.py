"""`pagoda kernels warm` for the mixture-of-experts models of the catalogue: the grouped-GEMM variants the MoE
layers launch (Qwen3-MoE and Mixtral: silu-and-mul between, the routing weights scaled into the down GEMM;
gpt-oss: biased experts, an unscaled down GEMM) and gpt-oss's attention with sinks are in the warm plan; the
layers launched as the engine launches them (meta tensors, variants recorded, nothing compiled) need no
variant the warm of the same plan lacks. In a subprocess: this session keeps Triton in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import ast, json
    import torch
    from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
    from pagoda.engine.attention.triton_backend import TritonAttentionBackend
    from pagoda.engine.cli.kernels import _parser, plan_unit
    from pagoda.engine.cli.plan import resolve_shape
    from pagoda.engine.models.gpt_oss import biased_experts
    from pagoda.engine.sizing import lookup_gpu
    from pagoda.kernels.aot import recording_for
    from pagoda.kernels.fused_moe import fused_experts
    from pagoda.kernels.paged_decode import _paged_decode_kernel
    from pagoda.kernels.paged_prefill import _paged_prefill_kernel
    from pagoda.kernels.warm import launch_plan

    META = torch.device("meta")
    ATTENTION = {k.__name__: k for k in (_paged_decode_kernel, _paged_prefill_kernel)}

    def flag(key, name):
        names = ATTENTION[key[0]].arg_names
        return {names[i[0]]: v for i, v in ast.literal_eval(key[2])}.get(name, False)

    def step(query_lens, seq_lens):
        i32 = dict(dtype=torch.int32, device=META)
        t = sum(query_lens)
        return AttentionMetadata(
            num_seqs=len(query_lens), num_tokens=t, query_start_loc=torch.empty(len(query_lens) + 1, **i32),
            seq_lens=torch.empty(len(query_lens), **i32), context_lens=torch.empty(len(query_lens), **i32),
            block_tables=torch.empty((len(query_lens), 64), **i32),
            slot_mapping=torch.empty(t, dtype=torch.int64, device=META), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), query_lens_list=query_lens, seq_lens_list=seq_lens,
        )

    STEPS = [step([5, 1, 40], [5, 300, 900]), step([1], [1000]), step([1] * 64, [700] * 64)]
    args = _parser().parse_args(["warm", "--gpu", "x"])
    report = {}
    for gpu, model, tp in (("H100", "openai/gpt-oss-20b", None), ("H100", "openai/gpt-oss-120b", "4"),
                           ("H100", "Qwen/Qwen3-30B-A3B", None), ("A100-80GB", "Mixtral-8x7B", "2")):
        shape = resolve_shape(model)
        a = _parser().parse_args(["warm", "--gpu", "x", *(["--tensor-parallel-size", tp] if tp else [])])
        plan = plan_unit(lookup_gpu(gpu), model, shape, a).plan
        with recording_for(plan.limits) as warmed:
            launch_plan(plan)
        dtype, kv_dtype = getattr(torch, plan.dtype), getattr(torch, plan.kv_cache_dtype)
        backend = TritonAttentionBackend()
        with recording_for(plan.limits) as served:
            for heads, kv_heads in plan.ranks:
                kv = torch.empty((2, 256, plan.block_size, kv_heads, plan.head_dim), dtype=kv_dtype, device=META)
                scales = torch.empty(kv.shape[:4], device=META) if kv_dtype == torch.int8 else None
                cache = LayerKVCache(kv, scales=scales)
                sinks = torch.empty(heads, device=META) if plan.attention_sinks else None
                for meta in STEPS:
                    t, d = meta.num_tokens, plan.head_dim
                    qkv = torch.empty((t, (heads + 2 * kv_heads) * d), dtype=dtype, device=META)
                    q = qkv[:, : heads * d].view(t, heads, d)
                    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
                    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
                    for window in {shape.sliding_window, None}:
                        backend.forward(q, k, v, cache, meta, d**-0.5, window, sinks=sinks)
                    e, h, i = plan.experts, plan.hidden_size, plan.moe_intermediate
                    x = torch.empty((t, h), dtype=dtype, device=META)
                    w13 = torch.empty((e, 2 * i, h), dtype=dtype, device=META)
                    w2 = torch.empty((e, h, i), dtype=dtype, device=META)
                    topk = shape.experts_per_token
                    weights = torch.empty((t, topk), device=META)
                    ids = torch.empty((t, topk), dtype=torch.int64, device=META)
                    if plan.expert_bias:
                        b13 = torch.empty((e, 2 * i), dtype=dtype, device=META)
                        b2 = torch.empty((e, h), dtype=dtype, device=META)
                        biased_experts(x, w13, b13, w2, b2, weights, ids, 1.702, 7.0, triton=True)
                    else:
                        fused_experts(x, w13, w2, weights, ids)
        report[model] = {"missing": [k[0] for k in served - warmed], "served": sorted({k[0] for k in served}),
                         "sinks": sorted({flag(k, "SINKS") for k in served if k[0] in ATTENTION}),
                         "experts": plan.experts, "moe_intermediate": plan.moe_intermediate}
    print(json.dumps(report))
    """
)


def test_the_moe_layers_and_gpt_oss_sinks_are_warmed():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for model, r in report.items():
        assert r["missing"] == [], (model, r["missing"])
        assert "_moe_gemm_kernel" in r["served"], (model, r["served"])
    assert report["openai/gpt-oss-20b"]["sinks"] == [True] and report["Qwen/Qwen3-30B-A3B"]["sinks"] == [
        False
    ]
    assert (report["openai/gpt-oss-20b"]["experts"], report["openai/gpt-oss-20b"]["moe_intermediate"]) == (
        32,
        2880,
    )
    assert report["openai/gpt-oss-120b"]["moe_intermediate"] == 2880 // 4  # each of 4 ranks' slice
    assert report["Mixtral-8x7B"]["moe_intermediate"] == 14336 // 2
