"""Kernel benchmark: paged decode and prefill attention against same-run baselines on a GPU; CPU rows elsewhere.

    make bench-kernels            # or: python benchmarks/bench_kernels.py [--quick] [--skip-e2e]
    python benchmarks/bench_kernels.py --cpu [--quick] [--compare OLD_LIB_DIR]   # the CPU kernels' rows

Without a visible CUDA GPU, or with --cpu, the run is bench_kernels_cpu.py's: the C kernels of the CPU path on
every variant this CPU runs (its docstring says what and how); the rest of this docstring is the GPU run.

Decode: batch {1, 8, 64, 256} x context {512, 4096, 32768}, Llama-3-8B attention shape (32 query / 8 KV
heads, dim 128), bf16 and FP8 (e4m3) KV, block size 16. Each point is the median of CUDA-event-timed runs
after warm-up, rotating through enough copies of the inputs that L2 cannot hold them. Achieved bandwidth =
minimum bytes (KV bytes per token x context tokens in the batch, plus q and out) / time, also shown as a
fraction of the device-to-device copy bandwidth measured in the same run. Side by side: the torch paged
twin, SDPA over contiguous KV, and FlashInfer's BatchDecodeWithPagedKVCacheWrapper when importable.
Prefill: 512..8192 tokens, causal, against SDPA (flash). End to end: a ~1B random Llama, greedy tokens
with triton vs torch backends, and decode tokens/s of each. Writes bench-results/kernels.json and .png.

Both runs end with the fused mixture-of-experts layer (bench_moe.py: the experts as the engine runs them, the
Triton grouped GEMM on a GPU and grouped torch ops on the CPU, against a per-expert loop and a dense MLP of the
active size), written to moe.json beside the kernels' JSON; --skip-moe leaves it out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

RESULTS = Path("bench-results")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def cuda_time_ms(fn, inputs: list, warmup: int = 5, iters: int = 30) -> float:
    """Median time of fn(*inputs[i % len]) in ms, CUDA events around each call."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copies_for_l2(bytes_per_copy: int, device: torch.device, cap: int = 8) -> int:
    """How many input copies to rotate so the set is at least 3x L2 (or as many as memory allows)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    free = torch.cuda.mem_get_info(device)[0]
    want = max(1, math.ceil(3 * l2 / max(1, bytes_per_copy)))
    fits = max(1, int(0.5 * free // max(1, bytes_per_copy)))
    return min(want, fits, cap)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), [()], warmup=3, iters=20)
    return 2 * n / (ms / 1e3)


def make_decode_inputs(batch: int, ctx: int, kv_dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = ctx // BLOCK
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(
        (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16
    )
    kv = kv.to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, kv, tables, lens


def bench_decode(device, copy_bw, quick: bool, flashinfer) -> list[dict]:
    from pagoda.kernels.paged_decode import paged_decode_attention
    from pagoda.kernels.reference import paged_decode_attention_ref

    batches = [1, 8, 64] if quick else [1, 8, 64, 256]
    contexts = [512, 4096] if quick else [512, 4096, 32768]
    rows = []
    scale = HEAD_DIM**-0.5
    from tqdm.auto import tqdm

    points = [
        (kv_name, kv_dtype, batch, ctx)
        for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn))
        for batch in batches
        for ctx in contexts
    ]
    for kv_name, kv_dtype, batch, ctx in tqdm(points, desc="paged decode"):
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
        if kv_bytes > 0.4 * torch.cuda.mem_get_info(device)[0]:
            continue
        n_copies = copies_for_l2(kv_bytes, device)
        inputs = [make_decode_inputs(batch, ctx, kv_dtype, device, s) for s in range(n_copies)]
        min_bytes = kv_bytes + 2 * batch * HEADS * HEAD_DIM * 2  # KV once, q in, out back
        q0, kv0, t0, l0 = inputs[0]
        out = paged_decode_attention(q0, kv0, t0, l0, scale, max_seq_len=ctx)
        ref = paged_decode_attention_ref(q0, kv0, l0, t0, scale)
        max_err = (out.float() - ref.float()).abs().max().item()
        row = dict(kernel="decode", kv=kv_name, batch=batch, context=ctx, min_bytes=min_bytes,
                   max_abs_err_vs_twin=max_err)  # fmt: skip

        row["triton_ms"] = cuda_time_ms(
            lambda q, kv, t, ln, c=ctx: paged_decode_attention(q, kv, t, ln, scale, max_seq_len=c),
            inputs,
        )
        if batch * ctx <= 64 * 4096:  # the twin gathers the whole batch: keep it to what fits
            row["torch_twin_ms"] = cuda_time_ms(
                lambda q, kv, t, ln: paged_decode_attention_ref(q, kv, ln, t, scale), inputs[:1], 2, 5
            )
        if kv_dtype == torch.bfloat16:
            kc = kv0[0, t0.long()].reshape(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
            vc = kv0[1, t0.long()].reshape(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
            kc, vc, qc = kc.contiguous(), vc.contiguous(), q0.unsqueeze(2)
            row["sdpa_contiguous_ms"] = cuda_time_ms(
                lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, enable_gqa=True),
                [(qc, kc, vc)],
            )
            del kc, vc
        if flashinfer is not None:
            row["flashinfer_ms"] = bench_flashinfer(flashinfer, inputs, batch, ctx, device)
        for key in [k for k in row if k.endswith("_ms")]:
            gbps = min_bytes / (row[key] / 1e3)
            row[key.replace("_ms", "_GBps")] = gbps / 1e9
        row["triton_frac_of_copy_bw"] = min_bytes / (row["triton_ms"] / 1e3) / copy_bw
        rows.append(row)
        print_row(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def bench_flashinfer(flashinfer, inputs, batch, ctx, device) -> float | None:
    try:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        blocks_per_seq = ctx // BLOCK
        indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * blocks_per_seq
        last = torch.full((batch,), BLOCK, dtype=torch.int32, device=device)
        q0, kv0, t0, _ = inputs[0]
        wrapper.plan(indptr, t0.flatten(), last, HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                     q_data_type=torch.bfloat16, kv_data_type=kv0.dtype)  # fmt: skip
        fi_inputs = [(q, (kv[0], kv[1])) for q, kv, _, _ in inputs]
        return cuda_time_ms(lambda q, kv: wrapper.run(q, kv), fi_inputs)
    except Exception as exc:  # noqa: BLE001 - a baseline that fails must not sink the run
        print(f"  flashinfer failed: {exc}")
        return None


def bench_prefill(device, quick: bool) -> list[dict]:
    from pagoda.kernels.paged_prefill import paged_prefill_attention

    rows = []
    scale = HEAD_DIM**-0.5
    for n in [512, 2048] if quick else [512, 1024, 2048, 4096, 8192]:
        gen = torch.Generator(device=device).manual_seed(n)
        nb = n // BLOCK
        kv = torch.randn(
            (2, nb, BLOCK, KV_HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16
        )
        tables = torch.randperm(nb, generator=gen, device=device).to(torch.int32)[None]
        q = torch.randn((n, HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        ms = cuda_time_ms(
            lambda *a, n=n: paged_prefill_attention(*a, scale, max_query_len=n), [(q, kv, qsl, lens, tables)]
        )
        kc = kv[0, tables[0].long()].reshape(n, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
        vc = kv[1, tables[0].long()].reshape(n, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
        qc = q.transpose(0, 1)[None]
        sdpa_ms = cuda_time_ms(
            lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True),
            [(qc, kc, vc)],
        )
        out = paged_prefill_attention(q, kv, qsl, lens, tables, scale, max_query_len=n)
        ref = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        err = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
        flops = 4 * n * n * HEADS * HEAD_DIM / 2  # causal: half the square
        row = dict(kernel="prefill", tokens=n, triton_ms=ms, sdpa_ms=sdpa_ms, triton_TFLOPs=flops / ms / 1e9,
                   sdpa_TFLOPs=flops / sdpa_ms / 1e9, triton_frac_of_sdpa=sdpa_ms / ms, max_abs_err_vs_sdpa=err)  # fmt: skip
        rows.append(row)
        print_row(row)
    return rows


def bench_e2e(device) -> dict:
    """~1B random Llama: same greedy tokens with triton and torch backends, and decode tokens/s."""
    import time

    import transformers
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.loader import resolve_model

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="pagoda-bench-"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
            else:
                p.fill_(1.0)
    model.save_pretrained(tmp, safe_serialization=True)
    tok_src = Path(resolve_model(None))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_src / name).exists():
            (tmp / name).write_bytes((tok_src / name).read_bytes())
    del model
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (7, 64, 200, 513) * 8]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    result = {"params": "~1.1B (TinyLlama shape), bf16", "prompts": len(prompts)}
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tmp), attention_backend=backend, device="cuda", max_model_len=1024)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up (kernel compilation)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        result[f"{backend}_tok_per_s"] = sum(len(t) for t in tokens[backend]) / elapsed
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(tokens["torch"], tokens["triton"], strict=True))
    result["sequences_identical"] = f"{same}/{len(prompts)}"
    print(f"e2e: identical greedy sequences {same}/{len(prompts)}; tok/s torch "
          f"{result['torch_tok_per_s']:.0f}, triton {result['triton_tok_per_s']:.0f}")  # fmt: skip
    return result


def print_row(row: dict) -> None:
    cells = []
    for k, v in row.items():
        if k == "min_bytes":
            continue
        cells.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    print("  " + "  ".join(cells))


def plot(decode_rows: list[dict], prefill_rows: list[dict], copy_bw: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for kv in ("bf16", "fp8_e4m3"):
        for ctx in sorted({r["context"] for r in decode_rows}):
            pts = [r for r in decode_rows if r["kv"] == kv and r["context"] == ctx]
            if pts:
                ax1.plot([r["batch"] for r in pts], [r["triton_GBps"] for r in pts], marker="o",
                         linestyle="-" if kv == "bf16" else "--", label=f"triton {kv} ctx {ctx}")  # fmt: skip
        fi = [r for r in decode_rows if r["kv"] == kv and r.get("flashinfer_GBps") and r["context"] == 4096]
        if fi:
            ax1.plot(
                [r["batch"] for r in fi],
                [r["flashinfer_GBps"] for r in fi],
                marker="x",
                label="flashinfer ctx 4096",
            )
    ax1.axhline(copy_bw / 1e9, color="k", linewidth=0.8, label="D2D copy")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch")
    ax1.set_ylabel("achieved GB/s (min bytes / time)")
    ax1.set_title("paged decode, 32q/8kv x 128, block 16")
    ax1.legend(fontsize=7)
    if prefill_rows:
        ax2.plot(
            [r["tokens"] for r in prefill_rows],
            [r["triton_TFLOPs"] for r in prefill_rows],
            marker="o",
            label="triton",
        )
        ax2.plot(
            [r["tokens"] for r in prefill_rows],
            [r["sdpa_TFLOPs"] for r in prefill_rows],
            marker="s",
            label="SDPA",
        )
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("prompt tokens")
        ax2.set_ylabel("TFLOP/s (causal)")
        ax2.set_title("prefill, bf16")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the ~1B end-to-end check")
    parser.add_argument("--cpu", action="store_true", help="the CPU kernels' rows instead (what runs without a "
                        "GPU): bench_kernels_cpu.py, which takes --tiny, --compare OLD_LIB_DIR, --compare-rev REV, "
                        "--variants, --threads, --repeats, --out too")  # fmt: skip
    parser.add_argument(
        "--skip-moe", action="store_true", help="skip the fused MoE layer's rows (bench_moe.py)"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    skip_moe = "--skip-moe" in argv
    argv = [a for a in argv if a != "--skip-moe"]
    if "--cpu" in argv or not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_kernels_cpu

        if "--cpu" not in argv:
            print("no CUDA GPU visible: the CPU kernels' rows (bench_kernels_cpu.py)")
        rc = bench_kernels_cpu.main([a for a in argv if a != "--cpu"])
        return rc or (0 if skip_moe else run_moe(argv, _out_dir(argv, RESULTS), cpu=True))
    args = parser.parse_args(argv)
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        flashinfer = None
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    import triton

    copy_bw = copy_bandwidth(device)
    print(f"{props.name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}, flashinfer {'yes' if flashinfer else 'not importable'}")  # fmt: skip
    decode_rows = bench_decode(device, copy_bw, args.quick, flashinfer)
    prefill_rows = bench_prefill(device, args.quick)
    e2e = None if args.skip_e2e else bench_e2e(device)

    def pick(kv, batch, ctx):
        return next(
            (r for r in decode_rows if r["kv"] == kv and r["batch"] == batch and r["context"] == ctx), None
        )

    bf, f8 = pick("bf16", 64, 4096), pick("fp8_e4m3", 64, 4096)
    targets = {}
    if bf:
        targets["decode_64x4096_frac_of_copy_bw>=0.80"] = bf["triton_frac_of_copy_bw"]
        if bf.get("flashinfer_ms"):
            targets["decode_64x4096_speed_vs_flashinfer>=1.0"] = bf["flashinfer_ms"] / bf["triton_ms"]
    if bf and f8:
        targets["fp8_speedup_vs_bf16_64x4096>=1.8"] = bf["triton_ms"] / f8["triton_ms"]
    if prefill_rows:
        targets["prefill_min_frac_of_sdpa>=0.5"] = min(r["triton_frac_of_sdpa"] for r in prefill_rows)
    print("\ntargets:")
    for k, v in targets.items():
        print(f"  {k}: {v:.3f}")
    RESULTS.mkdir(exist_ok=True)
    report = dict(
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), gpu=props.name, torch=torch.__version__,
        triton=triton.__version__, copy_bandwidth_GBps=copy_bw / 1e9, decode=decode_rows, prefill=prefill_rows,
        e2e=e2e, targets=targets,
    )  # fmt: skip
    (RESULTS / "kernels.json").write_text(json.dumps(report, indent=2))
    plot(decode_rows, prefill_rows, copy_bw, RESULTS / "kernels.png")
    print(f"wrote {RESULTS / 'kernels.json'} and {RESULTS / 'kernels.png'}")
    return 0 if args.skip_moe else run_moe(argv, RESULTS, cpu=False)


def _out_dir(argv: list[str], default: Path) -> Path:
    """The folder of the CPU run's --out (so a test's run writes moe.json into its own folder)."""
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1]).parent
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1]).parent
    return default


def run_moe(argv: list[str], out_dir: Path, cpu: bool) -> int:
    """The fused MoE layer's rows (bench_moe.py) after the attention kernels': --tiny and --quick carry over.

    On a CPU at one thread (the first of --threads when given): on the shared 2-core host the two-thread rows
    swing by 10x with the load (an OpenMP team waits on a descheduled thread), the one-thread rows do not."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_moe

    moe_args = ["--out", str(out_dir / "moe.json")]
    if cpu:
        threads = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--threads"), "1")
        moe_args += ["--threads", threads.split(",")[0]]
    if "--tiny" in argv:
        moe_args.append("--tiny")
    elif "--quick" in argv:
        moe_args += ["--repeats", "5"]
    print("\nfused mixture-of-experts layer (bench_moe.py):")
    return bench_moe.main(moe_args)


if __name__ == "__main__":
    sys.exit(main())
