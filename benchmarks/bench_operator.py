"""Operator benchmark: CR-created -> StatefulSet-created latency, and time to reconcile 500 InferenceDeployments.

Against kmock's Kubernetes emulator over HTTP, the operator running under kopf in the same process (as in
the tests). Baseline, measured in the same run: the API floor, i.e. the same objects written straight to the
emulator by a client with no operator in between. Targets (issue 7): p99 under 1 s, 500 under 60 s.

    python benchmarks/bench_operator.py [--latency-samples 50] [--count 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time

from pagoda.operator import render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import parse_spec
from tqdm import tqdm

# The emulated cluster and the operator runner are test code (tests/support/pagoda_testkit), not shipped.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))
from pagoda_testkit import INFD, STS, Cluster, emulated_cluster, running_operator  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "bench-results"
TARGET_P99_S = 1.0
TARGET_500_S = 60.0


def cr(name: str) -> dict:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"},
            "gpu": {"product": "NVIDIA-L4", "count": 1},
        },
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def wait(check, timeout: float = 120.0, poll: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the operator did not keep up")
        await asyncio.sleep(poll)


async def latency(cluster: Cluster, samples: int) -> list[float]:
    out = []
    for i in tqdm(range(samples), desc="CR -> StatefulSet latency", unit="CR"):
        name = f"lat-{samples}-{i}"
        start = time.perf_counter()
        await cluster.create(cr(name))
        await wait(lambda n=name: cluster.get(STS, "default", n) is not None)
        out.append(time.perf_counter() - start)
    return out


async def throughput(cluster: Cluster, count: int) -> tuple[float, list[tuple[float, int]]]:
    """Seconds until every one of `count` CRs has its StatefulSet and a plan in its status."""
    names = [f"many-{i}" for i in range(count)]
    sem = asyncio.Semaphore(16)
    start = time.perf_counter()

    async def create(name: str) -> None:
        async with sem:
            await cluster.create(cr(name))

    creating = asyncio.gather(*(create(n) for n in names))
    curve: list[tuple[float, int]] = []
    pending = set(names)
    with tqdm(total=count, desc=f"reconcile {count}", unit="CR") as bar:
        while pending:
            await asyncio.sleep(0.2)
            finished = {
                n for n in pending
                if cluster.get(STS, "default", n) is not None
                and ((cluster.get(INFD, "default", n) or {}).get("status") or {}).get("plan")
            }  # fmt: skip
            pending -= finished
            bar.update(len(finished))
            curve.append((time.perf_counter() - start, count - len(pending)))
            if time.perf_counter() - start > 600:
                raise TimeoutError(f"only {count - len(pending)}/{count} reconciled after 600 s")
    await creating
    return time.perf_counter() - start, curve


async def baseline(cluster: Cluster, count: int) -> tuple[list[float], float]:
    """The API floor: create CR + its children + status straight from a client, no operator."""
    available = pools([g for g in [node_gpus(n) for n in cluster.objects("v1/nodes")] if g])
    spec = parse_spec(cr("x")["spec"])
    decision = decide(spec, available)

    async def one(name: str) -> None:
        body = await cluster.create(cr(name))
        for child in render.children(body, spec, decision, with_service_monitor=False):
            prefix, plural = {"Service": ("api/v1", "services"), "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
                              "StatefulSet": ("apis/apps/v1", "statefulsets")}[child["kind"]]  # fmt: skip
            await cluster._call("POST", f"/{prefix}/namespaces/default/{plural}", child)
        await cluster._call("PATCH", f"/apis/pagoda.dev/v1alpha1/namespaces/default/inferencedeployments/{name}/status",
                            {"status": {"plan": decision.plan.to_dict()}})  # fmt: skip

    lat = []
    for i in range(20):
        start = time.perf_counter()
        await one(f"base-lat-{i}")
        lat.append(time.perf_counter() - start)
    sem = asyncio.Semaphore(16)

    async def limited(name: str) -> None:
        async with sem:
            await one(name)

    start = time.perf_counter()
    await asyncio.gather(*(limited(f"base-{i}") for i in range(count)))
    return lat, time.perf_counter() - start


def plot(
    lat: list[float], base_lat: list[float], curve: list[tuple[float, int]], count: int, path: pathlib.Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for values, label in ((lat, "operator: CR -> StatefulSet"), (base_lat, "baseline: direct API writes")):
        xs = sorted(v * 1000 for v in values)
        ax1.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax1.axvline(TARGET_P99_S * 1000, color="red", linestyle="--", label="p99 target (1 s)")
    ax1.set_xscale("log")
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("fraction of CRs")
    ax1.legend()
    ax1.set_title("Create latency (CDF)")
    ax2.plot([t for t, _ in curve], [n for _, n in curve])
    ax2.axvline(TARGET_500_S, color="red", linestyle="--", label="target (60 s)")
    ax2.set_xlabel("seconds since the first create")
    ax2.set_ylabel("InferenceDeployments reconciled")
    ax2.set_title(f"Reconciling {count} InferenceDeployments")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main_async(args: argparse.Namespace) -> dict:
    async with emulated_cluster() as cluster:
        for i in range(4):
            await cluster.add_node(f"gpu-l4-{i}", "l4")
        base_lat, base_total = await baseline(cluster, args.count)
    async with emulated_cluster() as cluster:
        for i in range(4):
            await cluster.add_node(f"gpu-l4-{i}", "l4")
        async with running_operator(cluster):
            warmup = await latency(cluster, 1)  # the first CR also pays for the operator's first API calls
            lat = await latency(cluster, args.latency_samples)
            await cluster.settle(quiet=1.0, timeout=120)
    async with emulated_cluster() as cluster:  # a fresh cluster: the 500 are all there is
        for i in range(4):
            await cluster.add_node(f"gpu-l4-{i}", "l4")
        async with running_operator(cluster):
            total, curve = await throughput(cluster, args.count)
            await cluster.settle(quiet=1.0, timeout=120)
    return {
        "latency_s": {
            "p50": statistics.median(lat),
            "p99": pct(lat, 99),
            "max": max(lat),
            "samples": len(lat),
            "first_cr": warmup[0],
        },
        "baseline_latency_s": {"p50": statistics.median(base_lat), "p99": pct(base_lat, 99)},
        "reconcile_all_s": total,
        "baseline_all_s": base_total,
        "count": args.count,
        "curve": curve,
        "lat": lat,
        "base_lat": base_lat,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--count", type=int, default=500)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.ERROR)
    r = asyncio.run(main_async(args))
    ok_p99 = r["latency_s"]["p99"] < TARGET_P99_S
    ok_all = r["reconcile_all_s"] < TARGET_500_S
    rows = [
        ("CR -> StatefulSet p50", f"{r['latency_s']['p50'] * 1000:.1f} ms", f"{r['baseline_latency_s']['p50'] * 1000:.1f} ms", ""),
        ("CR -> StatefulSet p99", f"{r['latency_s']['p99'] * 1000:.1f} ms", f"{r['baseline_latency_s']['p99'] * 1000:.1f} ms",
         f"< {TARGET_P99_S * 1000:.0f} ms {'PASS' if ok_p99 else 'FAIL'}"),
        (f"reconcile {r['count']} CRs", f"{r['reconcile_all_s']:.1f} s", f"{r['baseline_all_s']:.1f} s",
         f"< {TARGET_500_S:.0f} s {'PASS' if ok_all else 'FAIL'}"),
    ]  # fmt: skip
    print(f"\n{'metric':<26}{'operator':>14}{'baseline (API floor)':>24}   target")
    for name, op, base, target in rows:
        print(f"{name:<26}{op:>14}{base:>24}   {target}")
    OUT.mkdir(exist_ok=True)
    plot(r["lat"], r["base_lat"], r["curve"], r["count"], OUT / "bench_operator.png")
    result = {k: v for k, v in r.items() if k not in ("curve", "lat", "base_lat")}
    result |= {
        "targets": {"p99_s": TARGET_P99_S, "reconcile_all_s": TARGET_500_S},
        "pass": {"p99": ok_p99, "reconcile_all": ok_all},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "samples_ms": [round(x * 1000, 2) for x in r["lat"]],
    }
    (OUT / "bench_operator.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {OUT / 'bench_operator.json'} and {OUT / 'bench_operator.png'}")
    return 0 if ok_p99 and ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
