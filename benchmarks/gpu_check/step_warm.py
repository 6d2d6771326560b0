"""`pagoda kernels warm` for this GPU and the check's model, into the cache the serve step then starts on.

The flags are the ones the serve step passes `pagoda serve` (dtype, KV dtype, block size, one rank), so the
variants warmed here are the ones the server launches; the serve step counts what it still compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpu_check.context import Context, check, verdict

# what both `kernels warm` and `serve` are given: the same plan, so the same kernel variants
PLAN_FLAGS = [
    "--dtype",
    "bfloat16",
    "--kv-cache-dtype",
    "auto",
    "--block-size",
    "16",
    "--tensor-parallel-size",
    "1",
]


def run(ctx: Context) -> dict:
    env_result = ctx.result_of("env") or {}
    gpu = (env_result.get("gpu") or {}).get("catalogue") if ctx.gpu else "H100"
    if gpu is None:
        return {"status": "error", "error": "this GPU is not in the sizing catalogue: nothing to warm for"}
    cmd = [
        sys.executable, "-m", "pagoda.cli.main", "kernels", "warm", "--gpu", gpu, "--model", str(ctx.model_dir),
        *PLAN_FLAGS, "--cache-dir", str(ctx.warm_cache), "--jobs", str(min(8, os.cpu_count() or 1)), "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stderr.write(done.stderr[-20000:])
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"status": "error", "error": f"exit {done.returncode}: {done.stderr.strip()[-800:]}"}
    variants = [r["variant"] for r in report["rows"]]
    entries = sorted(p.name for p in ctx.warm_cache.iterdir()) if ctx.warm_cache.is_dir() else []
    checks = {
        "exit_code": check(done.returncode == 0, done.returncode),
        "variants_compiled": check(bool(variants), f"{len(variants)}: " + ", ".join(variants)),
        "all_fit_shared_memory": check(all(r["fits"] for r in report["rows"]), report["errors"] or "yes"),
    }
    headline = (
        f"{len(variants)} variants for {gpu} in {report['seconds']:.1f} s ({len(entries)} cache entries)"
    )
    return verdict(checks, headline=headline, gpu=gpu, variants=variants, seconds_compiling=report["seconds"],
                   cache_entries=len(entries), command=" ".join(cmd))  # fmt: skip
