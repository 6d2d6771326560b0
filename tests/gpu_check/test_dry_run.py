"""`make gpu-check DRY_RUN=1`: the GPU check's script, its imports under the shim (checked against the GPU
machine's package list and the carried wheels) and its random-weight model, everything but the GPU steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "benchmarks" / "gpu_check" / "main.py"
sys.path.insert(0, str(MAIN.parents[1]))

from gpu_check import shim, wheels  # noqa: E402


def test_the_dry_run_passes_every_step_and_writes_its_json(tmp_path):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(
        [sys.executable, str(MAIN), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "dry"
    assert [s["step"] for s in report["steps"]] == ["env", "imports", "model"]
    assert report["summary"]["not_passed"] == {}, json.dumps(report["steps"], indent=1)[-4000:]
    imports = next(s for s in report["steps"] if s["step"] == "imports")
    assert imports["checks"]["through_the_shim"]["ok"] is True
    assert imports["checks"]["carried_list_complete"]["ok"] is True
    assert report["versions"]["torch"] and report["wheels"].get("error") is None
    assert out.with_suffix(".log").is_file()
    assert "step" in done.stdout and "imports" in done.stdout  # the table


def test_make_runs_the_dry_mode_with_the_venv_and_the_check_with_the_machines_python():
    dry = subprocess.run(["make", "-n", "gpu-check", "DRY_RUN=1"], cwd=REPO, capture_output=True, text=True)
    assert "benchmarks/gpu_check/main.py --dry-run" in dry.stdout and ".venv/bin/python" in dry.stdout
    real = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True)
    assert "python3 benchmarks/gpu_check/main.py" in real.stdout and "install" not in real.stdout


def test_the_shim_maps_the_folders_as_setup_py_does(tmp_path):
    mapping = shim.folders()
    assert mapping["engine"] == "pagoda.engine" and mapping["kernels"] == "pagoda.kernels"
    made = shim.make_shim(tmp_path)
    assert (made / "pagoda" / "engine").resolve() == REPO / "engine"
    assert not (made / "pagoda" / "__init__.py").exists()  # a namespace package, as installed


def test_a_dependency_neither_on_the_gpu_image_nor_carried_is_named():
    assert wheels.unexpected({"fastapi", "torch", "httptools"}) == []
    assert wheels.unexpected({"FastAPI", "some-new-dependency"}) == ["some-new-dependency"]
    assert len(set(wheels.carried_names())) == len(wheels.CARRIED)
    assert not set(wheels.carried_names()) & wheels.GPU_IMAGE
