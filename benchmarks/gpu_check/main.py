"""`make gpu-check` (or `python3 benchmarks/gpu_check/main.py`): Pagoda checked on this machine's GPU.

    python3 benchmarks/gpu_check/main.py              # the GPU check, under 8 minutes
    python3 benchmarks/gpu_check/main.py --dry-run    # everything but the GPU steps (CI)
    python3 benchmarks/gpu_check/main.py --prepare-wheels [--python 3.12 ...]   # fill .whl/ (needs an index)

Runs with the machine's own python3, torch and Triton; imports this checkout through a shim folder and
installs the carried wheels (.whl/) it lacks into a temporary folder. Steps, each in its own process and
time budget: versions and compute capability; the random-weight model (Llama-3.1-8B's shape, 8 layers);
`pagoda kernels warm` for this GPU into a cache; a served smoke run on that cache (start-up phases, tok/s
at 64 concurrent requests, /metrics, SIGTERM frees the GPU, and no kernel compiled at serve); the kernel
tests compiled on CUDA (every KV dtype, CUDA graphs against eager); a quick kernel benchmark. Prints a
table, writes JSON to $OUT/gpu-check.json when $OUT is set, else bench-results/gpu-check.json, and exits
0 whatever the steps gave (--strict: 1 when one did not pass).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `gpu_check` itself (PYTHONSAFEPATH is set)

from gpu_check import wheels  # noqa: E402
from gpu_check.context import Context  # noqa: E402
from gpu_check.runner import Step, run_steps, write_step_result  # noqa: E402
from gpu_check.shim import REPO, make_shim  # noqa: E402

TOTAL_S = 420.0  # every step's budget together: the check ends well inside 8 minutes

GPU_STEPS = [
    Step("env", 25, "versions, GPU and compute capability"),
    Step("model", 50, "random-weight Llama-3.1-8B-shaped model, 8 layers"),
    Step("warm", 60, "pagoda kernels warm for this GPU into a cache"),
    Step("serve", 135, "served smoke run on the warmed cache"),
    Step("kernel_tests", 105, "tests/kernels compiled on CUDA"),
    Step("bench", 45, "bench-kernels quick"),
]
DRY_STEPS = [
    Step("env", 25, "versions"),
    Step("imports", 40, "the steps' imports under the shim, against the carried wheel list"),
    Step("model", 25, "random-weight model files (tiny shape)"),
]
CPU_STEPS = [  # a rehearsal of the GPU run's code paths on the CPU, with the tiny model (not in --help)
    Step("env", 25, "versions"),
    Step("model", 25, "random-weight model files (tiny shape)"),
    Step("warm", 120, "pagoda kernels warm for an H100, compiled here"),
    Step("serve", 150, "served smoke run on the CPU"),
]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="everything but the GPU steps (what CI runs)")
    p.add_argument("--prepare-wheels", action="store_true", help="download the carried wheels into .whl/")
    p.add_argument("--python", action="append", help="with --prepare-wheels: Python versions (default 3.12)")
    p.add_argument("--wheels", type=Path, default=wheels.WHEEL_DIR, help="carried wheels (default .whl/)")
    p.add_argument("--out", help="JSON path (default $OUT/gpu-check.json, else bench-results/gpu-check.json)")
    p.add_argument("--total-seconds", type=float, default=TOTAL_S, help="the steps' budgets scaled to this")
    p.add_argument("--strict", action="store_true", help="exit 1 when a step did not pass")
    p.add_argument("--keep", action="store_true", help="keep the work folder (model, caches, logs)")
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.step:
        return run_step(args.step, Context(Path(args.work), args.mode))
    if args.prepare_wheels:
        names = wheels.prepare(args.wheels, tuple(args.python or wheels.PYTHON_VERSIONS))
        print(f"{len(names)} wheels in {args.wheels}:\n  " + "\n  ".join(names))
        return 0
    mode = "dry" if args.dry_run else "cpu" if args.cpu else "gpu"
    steps = {"dry": DRY_STEPS, "cpu": CPU_STEPS, "gpu": GPU_STEPS}[mode]
    scale = args.total_seconds / sum(s.budget_s for s in steps)
    steps = [Step(s.name, s.budget_s * min(1.0, scale), s.what) for s in steps]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pagoda-gpu-check-"))
    print(f"pagoda gpu-check ({mode}): python {platform.python_version()} at {sys.executable}; work {work}")
    shim = make_shim(work / "shim")
    site = work / "site"
    installed = wheels.install(site, args.wheels)
    print(f"carried wheels: installed {installed['installed'] or 'none'}; the machine has "
          f"{', '.join(f'{k} {v}' for k, v in installed['machine_has'].items()) or 'none of them'}")  # fmt: skip
    if installed.get("error"):
        print(f"carried wheels: {installed['error']}")
    env = child_env(shim, site)
    results = run_steps(steps, work, env, args.total_seconds, ["--mode", mode])
    report = build_report(mode, results, installed, time.monotonic() - started)
    path = Path(args.out) if args.out else default_out()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    write_logs(work, path.with_suffix(".log"), [s.name for s in steps])
    print_table(report)
    print(f"\nwrote {path} and {path.with_suffix('.log')}")
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if args.strict and report["summary"]["not_passed"] else 0


def child_env(shim: Path, site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(shim), str(site), str(Path(__file__).resolve().parents[1])]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu-check.json" if out else REPO / "bench-results" / "gpu-check.json"


def build_report(mode: str, results: list[dict], wheels_report: dict, seconds: float) -> dict:
    env = next((r for r in results if r["step"] == "env"), {})
    statuses = {r["step"]: r["status"] for r in results}
    return {
        "check": "pagoda gpu-check",
        "mode": mode,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "seconds": round(seconds, 1),
        "versions": env.get("versions"),
        "gpu": env.get("gpu"),
        "wheels": wheels_report,
        "summary": {
            "passed": [k for k, v in statuses.items() if v == "pass"],
            "not_passed": {k: v for k, v in statuses.items() if v != "pass"},
        },
        "steps": results,
    }


def write_logs(work: Path, dest: Path, names: list[str]) -> None:
    """Every step's output in one file (each cut to its last 200 kB), beside the JSON."""
    with open(dest, "w") as out:
        for name in names:
            for log in sorted(work.glob(f"{name}*.log")):
                text = log.read_text(errors="replace")
                out.write(f"===== {log.name} =====\n{text[-200_000:]}\n")


def print_table(report: dict) -> None:
    versions = report.get("versions") or {}
    gpu = report.get("gpu") or {}
    print("\n" + " ".join(f"{k} {v}" for k, v in versions.items() if v))
    if gpu:
        print(f"GPU: {gpu.get('name')} (compute capability {gpu.get('compute_capability')}, "
              f"{gpu.get('memory_gib')} GiB, driver {gpu.get('driver')})")  # fmt: skip
    print(f"\n{'step':<14} {'status':<6} {'seconds':>7}  result")
    for r in report["steps"]:
        line = r.get("headline") or r.get("error") or ""
        print(f"{r['step']:<14} {r['status']:<6} {r['seconds']:>7.1f}  {str(line)[:150]}")
        for sub, value in (r.get("checks") or {}).items():
            mark = "pass" if value.get("ok") else "FAIL" if value.get("ok") is False else "-"
            print(f"  {sub:<28} {mark:<5} {str(value.get('detail', ''))[:120]}")


def run_step(name: str, ctx: Context) -> int:
    """Child mode: run one step module, write its result; SIGTERM unwinds it (its `finally`s clean up)."""

    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        module = importlib.import_module(f"gpu_check.step_{name}")
        result = module.run(ctx)
    except BaseException as exc:  # noqa: BLE001 - the step's failure is its result
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        write_step_result(ctx.work, name, result)
        return 1
    write_step_result(ctx.work, name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
