"""The real kubectl and the real `pagoda-operator` process against the emulated API server.

The emulator serves no OpenAPI documents (GET /openapi/v3 and /openapi/v2 answer 404), so kubectl's
client-side validation must be off: `kubectl apply --validate=false`. Everything else kubectl needs here
(discovery, create, get with server-side printing as a Table) is served.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import socket
import sys

import pytest
from pagoda_testkit import CRD_FILE, EXAMPLES, INFD, STS, Cluster, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl") or str(ROOT / ".tools" / "bin" / "kubectl")


def kubeconfig(tmp_path: pathlib.Path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: emulator, cluster: {{server: "{url}"}}}}]
users: [{{name: tester, user: {{token: test-token}}}}]
contexts: [{{name: emulator, context: {{cluster: emulator, user: tester, namespace: default}}}}]
current-context: emulator
"""
    )
    return str(path)


async def sh(*cmd: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def test_kubectl_applies_the_crd_and_an_example_and_shows_printer_columns(
    cluster: Cluster, tmp_path
) -> None:
    assert os.access(KUBECTL, os.X_OK), "kubectl missing: run `make install` (scripts/install_tools.sh)"
    env = {**os.environ, "KUBECONFIG": kubeconfig(tmp_path, cluster.url)}
    await cluster.add_node("gpu-l4-1", "l4")
    async with running_operator(cluster):
        rc, out = await sh(KUBECTL, "apply", "--validate=false", "-f", str(CRD_FILE), env=env)
        assert rc == 0, out
        rc, out = await sh(
            KUBECTL, "apply", "--validate=false", "-f", str(EXAMPLES / "qwen2.5-7b-l4-fp8.yaml"), env=env
        )
        assert rc == 0 and "inferencedeployment.pagoda.dev/qwen2-5-7b created" in out, out
        await cluster.wait_for(lambda: cluster.get(STS, "default", "qwen2-5-7b"), what="StatefulSet")
        await cluster.wait_for(
            lambda: (cluster.get(INFD, "default", "qwen2-5-7b").get("status") or {}).get("plan"), what="plan"
        )
        rc, out = await sh(KUBECTL, "get", "infd", env=env)
        await cluster.settle()
    assert rc == 0, out
    header, row = [line.split() for line in out.strip().splitlines() if not line.startswith("Warning")][:2]
    assert header == ["NAME", "MODEL", "GPU", "REPLICAS", "READY", "MAXMODELLEN", "STATUS", "AGE"]
    assert row[:4] == ["qwen2-5-7b", "hf://Qwen/Qwen2.5-7B-Instruct", "NVIDIA-L4", "1"]
    assert row[5:7] == ["16384", "PodsNotReady"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_pagoda_operator_process_reconciles_and_serves_metrics(cluster: Cluster, tmp_path) -> None:
    env = {**os.environ, "KUBECONFIG": kubeconfig(tmp_path, cluster.url)}
    port, live = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from pagoda.operator.cli import main; raise SystemExit(main())",
        "--standalone", "--metrics-port", str(port), "--liveness", f"http://127.0.0.1:{live}/healthz",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await cluster.create({"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceDeployment",
                              "metadata": {"name": "tiny"}, "spec": {"gpu": {"count": 0}}})  # fmt: skip
        await cluster.wait_for(
            lambda: cluster.get(STS, "default", "tiny"), timeout=40, what="StatefulSet from the process"
        )
        await cluster.wait_for(
            lambda: (cluster.get(INFD, "default", "tiny").get("status") or {}).get("plan"), what="status"
        )
        await cluster.settle()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
        body = (await reader.read()).decode()
        writer.close()
        assert 'pagoda_operator_reconciles_total{result="success"}' in body
        assert 'pagoda_operator_inference_deployments{condition="Ready",status="False"} 1.0' in body
        reader, writer = await asyncio.open_connection("127.0.0.1", live)
        writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert b"200" in (await reader.readline())
        writer.close()
    finally:
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert b"Traceback" not in err, err.decode()[-3000:]


async def test_pagoda_render_runs_through_the_pagoda_command_without_torch() -> None:
    code = (
        "import sys\n"
        "from pagoda.cli.main import main\n"
        f"rc = main(['render', {str(EXAMPLES / 'llama-3.1-8b-h100-nvme.yaml')!r}])\n"
        "import pagoda.operator.cli, pagoda.operator.handlers\n"
        "assert 'torch' not in sys.modules, 'the operator imported torch'\n"
        "raise SystemExit(rc)\n"
    )
    rc, out = await sh(sys.executable, "-c", code, env=dict(os.environ))
    assert rc == 0, out
    assert (
        "kind: StatefulSet" in out
        and "--kv-offload-disk-dir" in out
        and "# InferenceDeployment llama-3-1-8b" in out
    )
