"""CPU linears of 1-64 rows, the kernels library's small-rows product against oneDNN's packed weight, on a
model's shapes (issue 40 item 4): the table behind the engine's measured choice (cpu_linear_choice.py).

    python benchmarks/bench_cpu_linear.py [--model M] [--threads 1,2] [--rows 1,2,4,8,16,32,64] [--calls 40]
                                          [--out bench-results/cpu-linear.json] [--tiny]

For each dtype (float32; bfloat16 as the engine runs it: on a CPU without bfloat16 multiply instructions both
sides compute in float32 over the bfloat16 weight, on one with AVX512-BF16 ours multiplies bfloat16 pairs and
oneDNN runs its bfloat16 kernel), linear shape (fused qkv, o, fused gate-up, down, lm_head at tensor-parallel
size 1), thread count and row count, both products run through the engine's own functions
(`cpu_linear._small_rows`, `cpu_linear.onednn_linear`) on random weights, calls interleaved, each call on the
next of enough copies of the weight to exceed the last-level cache twice, so that every weight arrives from
memory as a model's do in the engine (``--hot``: one copy, repeated calls run from cache). Each reported time
is the fastest and the median of ``--calls`` single calls: on a host shared with other work the fastest is the
product's own cost (preempted calls only ever add time), the median says how noisy the host was. Per row count
the model's linear time per decode step (layers x (qkv + o + gate-up + down) + lm_head) is given for ours,
oneDNN and the faster of the two per shape (what the measured choice gives).

Writes JSON (``--out``) and prints a markdown table. ``--tiny``: a toy model shape, two row counts, few calls
(the test's smoke mode).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _calls(fns: dict, calls: int) -> dict[str, list[float]]:
    """Seconds of each of ``calls`` single calls per candidate, interleaved, after two warm-up calls each."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        fn()
    for _ in range(calls):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def candidates(dtype: torch.dtype, weights: list, x: torch.Tensor) -> tuple[dict, str]:
    """The two products as `cpu_linear.linear` would run them for this dtype, each call on the next of
    ``weights`` [(weight, PackedWeight)], and the operand kind."""
    from pagoda.engine.models import cpu_linear

    turn = {"ours": 0, "onednn": 0}

    def next_weight(side: str) -> tuple:
        turn[side] += 1
        return weights[turn[side] % len(weights)]

    widen = dtype == torch.bfloat16 and cpu_linear.bfloat16_widens()
    xs = x.float() if widen else x  # as linear does there: float32 over the bfloat16 weight, rounded once
    kind = cpu_linear._small_rows_kind(xs, weights[0][0])
    fns = {"onednn": lambda: _onednn(cpu_linear, xs, next_weight("onednn"), dtype)}
    if kind is not None:
        fns["ours"] = lambda: cpu_linear._small_rows(xs, next_weight("ours")[0], None, kind).to(dtype)
    for w, pack in weights:  # packs made before timing
        cpu_linear.onednn_linear(xs, w, None, pack)
    return fns, str(kind)


def _onednn(cpu_linear, x: torch.Tensor, weight: tuple, dtype: torch.dtype) -> torch.Tensor:
    return cpu_linear.onednn_linear(x, weight[0], None, weight[1]).to(dtype)


def model_shapes(args: argparse.Namespace) -> tuple[str, int, list[tuple[str, int, int]]]:
    """(model, layers, [(name, n, k)]) of the linears a decode step runs."""
    if args.tiny:
        return (
            "tiny",
            2,
            [("qkv", 48, 32), ("o", 32, 32), ("gate_up", 128, 32), ("down", 32, 64), ("lm_head", 256, 32)],
        )
    from pagoda.engine.cli.kernels_cpu import linear_shapes
    from pagoda.engine.cli.plan import resolve_shape

    s = resolve_shape(args.model)
    names = ("qkv", "o", "gate_up", "down", "lm_head")
    return (
        s.name if args.model else f"the default model ({s.name})",
        s.num_layers,
        [(name, n, k) for name, (n, k) in zip(names, linear_shapes(args.model), strict=False)],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", default=None, help="thread counts, comma-separated (default: 1 and torch's)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", default=str(ROOT / "bench-results" / "cpu-linear.json"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument(
        "--hot", action="store_true", help="one copy of each weight: repeated calls run from cache"
    )
    args = p.parse_args(argv)
    from pagoda.engine.cli.kernels_cpu import report
    from pagoda.engine.models import cpu_linear
    from pagoda.engine.models.cpu_linear_choice import cold_copies
    from pagoda.kernels.cpu import loader

    all_threads = torch.get_num_threads()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, all_threads})
    rows_list = [2, 16] if args.tiny else [int(r) for r in args.rows.split(",")]
    calls = 3 if args.tiny else args.calls
    model, layers, shapes = model_shapes(args)
    per_layer = {"qkv", "o", "gate_up", "down"}
    info = report()
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, n, k in shapes:
            weight = torch.randn(n, k).to(dtype)
            copies = 1 if args.hot else cold_copies(weight.numel() * weight.element_size())
            weights = [
                (weight if i == 0 else weight.clone(), cpu_linear.PackedWeight()) for i in range(copies)
            ]
            for t in threads:
                torch.set_num_threads(t)
                for rows in rows_list:
                    x = torch.randn(rows, k).to(dtype)
                    with torch.no_grad():
                        fns, kind = candidates(dtype, weights, x)
                        times = _calls(fns, calls)
                    row = {"dtype": dtype_name, "linear": name, "n": n, "k": k, "threads": t, "rows": rows,
                           "kind": kind, "count": layers if name in per_layer else 1}  # fmt: skip
                    for cand, ts in times.items():
                        row[f"{cand}_min_us"] = round(min(ts) * 1e6, 2)
                        row[f"{cand}_median_us"] = round(statistics.median(ts) * 1e6, 2)
                    results.append(row)
    torch.set_num_threads(all_threads)
    steps = step_totals(results)
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {
            "cpu": info["cpu"],
            "extensions": info["extensions"],
            "kernels": info["kernels"],
            "cores": os.cpu_count(),
            "load": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },  # fmt: skip
        "model": model,
        "layers": layers,
        "calls": calls,
        "weights": "hot (one copy)" if args.hot else "cold (copies cycled past the last-level cache)",
        "rows": results,
        "steps": steps,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print_tables(out)
    if loader.current().lib is None:
        print("(no native kernels loaded: only oneDNN was timed)", file=sys.stderr)
    return 0


def step_totals(results: list[dict]) -> list[dict]:
    """Per dtype, threads and rows: the linears of one decode step, ours / oneDNN / the faster per shape."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in results:
        g = groups.setdefault(
            (r["dtype"], r["threads"], r["rows"]), {"ours": 0.0, "onednn": 0.0, "best": 0.0}
        )
        ours = r.get("ours_min_us", float("inf"))
        one = r["onednn_min_us"]
        g["ours"] += ours * r["count"]
        g["onednn"] += one * r["count"]
        g["best"] += min(ours, one) * r["count"]
    return [{"dtype": d, "threads": t, "rows": rows, **{k: round(v / 1000, 3) for k, v in g.items()}}
            for (d, t, rows), g in groups.items()]  # fmt: skip


def print_tables(out: dict) -> None:
    h = out["host"]
    print(f"{out['model']} linears on {h['cpu']} ({' '.join(h['extensions'])}), {h['kernels']}; "
          f"load {h['load'][0]:.1f} on {h['cores']} cores; weights {out['weights']}; fastest / median of "
          f"{out['calls']} calls, microseconds")  # fmt: skip
    print()
    print(
        "| dtype | linear [n x k] | threads | rows | ours min | oneDNN min | oneDNN/ours | ours median | oneDNN median |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        ours = r.get("ours_min_us")
        ratio = f"{r['onednn_min_us'] / ours:.2f}" if ours else "-"
        print(f"| {r['dtype']} | {r['linear']} [{r['n']} x {r['k']}] | {r['threads']} | {r['rows']} | "
              f"{ours if ours else '-'} | {r['onednn_min_us']} | {ratio} | {r.get('ours_median_us', '-')} | "
              f"{r['onednn_median_us']} |")  # fmt: skip
    print()
    print(f"Linears of one decode step ({out['layers']} layers + lm_head), ms (sum of the fastest calls):")
    print()
    print("| dtype | threads | rows | ours | oneDNN | faster per shape | oneDNN / faster |")
    print("|---|---|---|---|---|---|---|")
    for s in out["steps"]:
        print(f"| {s['dtype']} | {s['threads']} | {s['rows']} | {s['ours']} | {s['onednn']} | {s['best']} | "
              f"{s['onednn'] / s['best']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
