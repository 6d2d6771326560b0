"""Dry mode: every module of the engine and kernels imports under the shim, with the packages the GPU
machine has or the check carries (wheels.py), and the carried wheels are all in .whl/ when it exists."""

from __future__ import annotations

import importlib
import pkgutil
import re
import time

from gpu_check import wheels
from gpu_check.context import Context, check, verdict

PACKAGES = ("pagoda.engine", "pagoda.kernels", "pagoda.cli")
STEPS = ("step_env", "step_model", "step_warm", "step_serve", "step_kernel_tests", "step_bench")
# what `pagoda serve` imports lazily, once it serves (the walk above imports each module, not its functions)
SERVE_TIME = ("fastapi", "uvicorn", "zmq", "msgspec", "xgrammar", "platformdirs", "starlette", "pydantic")


def run(ctx: Context) -> dict:
    start = time.monotonic()
    failed: dict[str, str] = {}
    count = 0
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if ".cpu.build" in info.name or info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
                count += 1
            except Exception as exc:  # noqa: BLE001 - each failure is reported
                failed[info.name] = f"{type(exc).__name__}: {exc}"[:300]
    for name in (*(f"gpu_check.{s}" for s in STEPS), "bench_kernels", *SERVE_TIME):
        try:
            importlib.import_module(name)
            count += 1
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    import pagoda.engine

    shimmed = [p for p in pagoda.engine.__path__ if "/shim/pagoda/" in p]
    loaded = wheels.loaded_distributions()
    unexpected = wheels.unexpected(loaded)
    checks = {
        "imports": check(not failed, f"{count} modules" if not failed else failed),
        "through_the_shim": check(bool(shimmed), list(pagoda.engine.__path__)),
        "carried_list_complete": check(
            not unexpected,
            f"{len(loaded)} distributions, each on the GPU image, carried or optional"
            if not unexpected
            else f"imported but neither on the GPU image nor carried: {unexpected}",
        ),
        "wheels_prepared": wheel_files(),
    }
    return verdict(
        checks, headline=f"{count} modules in {time.monotonic() - start:.1f} s", loaded=sorted(loaded)
    )


def wheel_files() -> dict:
    """Each carried package has a wheel in .whl/ (for every Python version there), or .whl/ is absent."""
    if not wheels.WHEEL_DIR.is_dir():
        return check(None, f"{wheels.WHEEL_DIR} absent (make gpu-check-prepare fills it)")
    files = [p.name for p in wheels.WHEEL_DIR.glob("*.whl")]
    missing = []
    for req in wheels.CARRIED:
        name, version = req.split("==")
        pattern = re.compile(rf"^{re.escape(name.replace('-', '_'))}-{re.escape(version)}-", re.IGNORECASE)
        if not any(pattern.match(f) for f in files):
            missing.append(req)
    return check(not missing, f"missing {missing}" if missing else f"{len(files)} wheels")
