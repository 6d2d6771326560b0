"""bench-kernels, quick: paged decode at 64 sequences x 4096 tokens (GB/s against the GPU's datasheet peak and
its measured copy bandwidth) in bfloat16 and FP8 KV, and causal prefill against torch SDPA.

The measuring code is benchmarks/bench_kernels.py's (median of CUDA-event-timed runs over input copies
that L2 cannot hold); only the points are fewer.
"""

from __future__ import annotations

from gpu_check.context import Context, check, verdict

BATCH, CONTEXT = 64, 4096
PREFILL_TOKENS = (512, 2048)


def run(ctx: Context) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "error", "error": "torch sees no CUDA device"}
    import bench_kernels as bk
    from pagoda.kernels.paged_decode import paged_decode_attention
    from pagoda.kernels.paged_prefill import paged_prefill_attention
    from pagoda.kernels.reference import paged_decode_attention_ref

    device = torch.device("cuda")
    peak = ((ctx.result_of("env") or {}).get("gpu") or {}).get("datasheet_bandwidth_gbps")
    copy_bw = bk.copy_bandwidth(device) / 1e9
    scale = bk.HEAD_DIM**-0.5
    decode = {}
    kv_dtypes = {"bf16": torch.bfloat16}
    if torch.cuda.get_device_capability() >= (8, 9):
        kv_dtypes["fp8_e4m3"] = torch.float8_e4m3fn
    for name, kv_dtype in kv_dtypes.items():
        kv_bytes = 2 * BATCH * CONTEXT * bk.KV_HEADS * bk.HEAD_DIM * kv_dtype.itemsize
        inputs = [
            bk.make_decode_inputs(BATCH, CONTEXT, kv_dtype, device, s)
            for s in range(bk.copies_for_l2(kv_bytes, device))
        ]
        min_bytes = kv_bytes + 2 * BATCH * bk.HEADS * bk.HEAD_DIM * 2
        q, kv, tables, lens = inputs[0]
        out = paged_decode_attention(q, kv, tables, lens, scale, max_seq_len=CONTEXT)
        err = (
            (out.float() - paged_decode_attention_ref(q, kv, lens, tables, scale).float()).abs().max().item()
        )
        ms = bk.cuda_time_ms(
            lambda q, kv, t, n: paged_decode_attention(q, kv, t, n, scale, max_seq_len=CONTEXT), inputs
        )
        gbps = min_bytes / (ms / 1e3) / 1e9
        decode[name] = {
            "ms": round(ms, 4), "GBps": round(gbps, 1), "frac_of_datasheet_peak": round(gbps / peak, 3) if peak else None,
            "frac_of_copy_bandwidth": round(gbps / copy_bw, 3), "max_abs_err_vs_twin": err,
        }  # fmt: skip
        del inputs, q, kv, tables, lens, out
        torch.cuda.empty_cache()
    prefill = {str(r["tokens"]): r for r in prefill_rows(bk, paged_prefill_attention, device, scale)}
    checks = {
        f"decode_{name}_64x4096": check(
            r["max_abs_err_vs_twin"] < 0.05,
            f"{r['GBps']} GB/s = {r['frac_of_datasheet_peak']} of the {peak} GB/s datasheet peak, "
            f"{r['frac_of_copy_bandwidth']} of the measured copy ({copy_bw:.0f} GB/s); err {r['max_abs_err_vs_twin']:.2g}",
        )
        for name, r in decode.items()
    }  # fmt: skip
    for n, r in prefill.items():
        checks[f"prefill_{n}_vs_sdpa"] = check(
            r["max_abs_err_vs_sdpa"] < 0.05,
            f"{r['triton_TFLOPs']:.0f} TFLOP/s, {r['triton_frac_of_sdpa']:.2f}x SDPA's speed; err {r['max_abs_err_vs_sdpa']:.2g}",
        )
    bf = decode.get("bf16", {})
    headline = (
        f"decode 64x4096 bf16 {bf.get('GBps')} GB/s ({bf.get('frac_of_datasheet_peak')} of peak); prefill "
        + ", ".join(f"{n}: {r['triton_frac_of_sdpa']:.2f}x SDPA" for n, r in prefill.items())
    )
    return verdict(checks, headline=headline, copy_bandwidth_GBps=round(copy_bw, 1), datasheet_peak_GBps=peak,
                   decode=decode, prefill=prefill)  # fmt: skip


def prefill_rows(bk, paged_prefill_attention, device, scale) -> list[dict]:
    import torch

    rows = []
    for n in PREFILL_TOKENS:
        gen = torch.Generator(device=device).manual_seed(n)
        nb = n // bk.BLOCK
        kv = torch.randn(
            (2, nb, bk.BLOCK, bk.KV_HEADS, bk.HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16
        )
        tables = torch.randperm(nb, generator=gen, device=device).to(torch.int32)[None]
        q = torch.randn((n, bk.HEADS, bk.HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        ms = bk.cuda_time_ms(
            lambda *a, n=n: paged_prefill_attention(*a, scale, max_query_len=n), [(q, kv, qsl, lens, tables)]
        )
        kc = kv[0, tables[0].long()].reshape(n, bk.KV_HEADS, bk.HEAD_DIM).transpose(0, 1)[None]
        vc = kv[1, tables[0].long()].reshape(n, bk.KV_HEADS, bk.HEAD_DIM).transpose(0, 1)[None]
        qc = q.transpose(0, 1)[None]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms = bk.cuda_time_ms(lambda *a, f=sdpa: f(*a, is_causal=True, enable_gqa=True), [(qc, kc, vc)])
        out = paged_prefill_attention(q, kv, qsl, lens, tables, scale, max_query_len=n)
        ref = sdpa(qc, kc, vc, is_causal=True, enable_gqa=True)
        err = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
        flops = 4 * n * n * bk.HEADS * bk.HEAD_DIM / 2
        rows.append({
            "tokens": n, "triton_ms": round(ms, 4), "sdpa_ms": round(sdpa_ms, 4), "triton_TFLOPs": flops / ms / 1e9,
            "sdpa_TFLOPs": flops / sdpa_ms / 1e9, "triton_frac_of_sdpa": sdpa_ms / ms, "max_abs_err_vs_sdpa": err,
        })  # fmt: skip
    return rows
