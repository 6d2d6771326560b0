"""Versions (the machine's against the project's pins), the GPU, its compute capability and catalogue entry."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import tomllib

from gpu_check.context import Context, check, verdict
from gpu_check.shim import REPO
from gpu_check.wheels import installed_version


def project_pins() -> dict[str, str]:
    """torch and triton as pyproject.toml pins them (what CI and the images run)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in project["optional-dependencies"]["engine"] + project["optional-dependencies"]["triton"]:
        m = re.match(r"^(torch|triton)==([\w.]+)$", req)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def run(ctx: Context) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": installed_version("transformers"),
        "tokenizers": installed_version("tokenizers"),
        "numpy": installed_version("numpy"),
    }
    pins = project_pins()
    differs = {
        name: f"{versions[name]} here, {pin} in pyproject.toml"
        for name, pin in pins.items()
        if versions.get(name) is None or versions[name].split("+")[0] != pin
    }
    checks = {
        "torch_imports": check(True, versions["torch"]),
        "triton_imports": check(triton_version is not None, triton_version or "not installed"),
        "versions_as_pinned": check(None, differs or "same as pyproject.toml"),
    }
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cc = (props.major, props.minor)
        gpu = {
            "name": props.name,
            "compute_capability": f"{cc[0]}.{cc[1]}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            "driver": driver_version(),
            "torch_arch_list": torch.cuda.get_arch_list(),
        }
        gpu.update(catalogue_entry(props.name))
        checks["cuda_device"] = check(True, f"{props.name}, compute capability {cc[0]}.{cc[1]}")
        arch_ok = any(a == f"sm_{cc[0]}{cc[1]}" or a == f"sm_{cc[0]}0" for a in gpu["torch_arch_list"])
        checks["torch_builds_for_this_gpu"] = check(arch_ok, ", ".join(gpu["torch_arch_list"]))
        checks["in_catalogue"] = check(
            gpu.get("catalogue") is not None, gpu.get("catalogue") or gpu.get("lookup")
        )
    elif ctx.gpu:
        checks["cuda_device"] = check(False, "torch sees no CUDA device")
    headline = f"python {versions['python']}, torch {versions['torch']}, triton {triton_version}"
    if gpu:
        headline += f"; {gpu['name']} cc {gpu['compute_capability']}, driver {gpu['driver']}"
    if differs:
        headline += " (not the project's pins: " + "; ".join(f"{k} {v}" for k, v in differs.items()) + ")"
    return verdict(checks, headline=headline, versions=versions, pins=pins, gpu=gpu)


def catalogue_entry(device_name: str) -> dict:
    """The sizing catalogue's entry for this GPU (GFD's product label is the name with spaces as dashes)."""
    from pagoda.engine.sizing import lookup_gpu

    try:
        spec = lookup_gpu(device_name.replace(" ", "-"))
    except ValueError as exc:
        return {"catalogue": None, "lookup": str(exc)[:200]}
    return {"catalogue": spec.name, "datasheet_bandwidth_gbps": spec.bandwidth_gbps}
