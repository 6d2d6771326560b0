"""The README's Kubernetes quickstart, command by command, so it cannot rot: helm lint/template of the chart
(`helm install` needs a real cluster), the real kubectl against the emulated API server with the operator
reconciling, the engine the operator rendered started here with the rendered arguments (what
`kubectl port-forward` would reach), and the README's curl against it. A command this test does not know
fails it: teach it the new command, or keep the command out of the quickstart."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pagoda_testkit import INFD, STS, Cluster, running_operator
from pagoda_testkit.processes import free_port

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
PAGODA = str(Path(sys.executable).parent / "pagoda")


def tool(name: str) -> str:
    path = TOOLS / name
    return str(path) if path.is_file() else name


def quickstart() -> list[str]:
    """The commands between the quickstart markers, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- quickstart:begin", 1)[1].split("<!-- quickstart:end -->", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words:
                commands.append(command)
    return commands


async def sh(argv: list[str], env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0, f"{shlex.join(argv)}:\n{out.decode()}"
    return out.decode()


def kubeconfig(tmp_path: Path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        f'apiVersion: v1\nkind: Config\nclusters: [{{name: e, cluster: {{server: "{url}"}}}}]\n'
        "users: [{name: t, user: {token: test-token}}]\n"
        "contexts: [{name: e, context: {cluster: e, user: t, namespace: default}}]\ncurrent-context: e\n"
    )
    return str(path)


async def make_ready(cluster: Cluster, name: str) -> None:
    """What the StatefulSet controller and the kubelet report once the engine pod is Ready."""
    sts = await cluster.wait_for(lambda: cluster.get(STS, "default", name), what=f"StatefulSet {name}")
    n = sts["spec"]["replicas"]
    status = {"replicas": n, "readyReplicas": n, "updatedReplicas": n,
              "observedGeneration": sts["metadata"].get("generation", 1)}  # fmt: skip
    await cluster.patch(STS, "default", name, {"status": status})


def model_phase(cluster: Cluster, name: str) -> str | None:
    infd = cluster.get(INFD, "default", name) or {}
    return ((infd.get("status") or {}).get("model") or {}).get("phase")


def test_the_quickstart_has_the_steps_a_new_user_needs() -> None:
    commands = " ".join(quickstart())
    for step in ("helm install pagoda charts/pagoda", "kubectl apply -f examples/", "kubectl get inferencedeployments",
                 "kubectl port-forward", "curl", "kubectl create secret generic hf-token"):  # fmt: skip
        assert step in commands, step


@pytest.mark.asyncio
async def test_every_quickstart_command_runs(cluster: Cluster, tmp_path) -> None:
    env = {**os.environ, "KUBECONFIG": kubeconfig(tmp_path, cluster.url)}
    await cluster.add_node("cpu-1", None)
    await cluster.add_node("gpu-h100-1", "h100")
    engine: subprocess.Popen | None = None
    port = None
    ran: list[str] = []
    try:
        async with running_operator(cluster):
            for command in quickstart():
                words = shlex.split(command, comments=True)
                words = words[:-1] if words[-1] == "&" else words
                if words[:2] == ["helm", "install"]:
                    release, chart = words[2], words[3]
                    namespace = words[words.index("-n") + 1]
                    await sh([tool("helm"), "lint", str(ROOT / chart)], env)
                    out = await sh([tool("helm"), "template", release, str(ROOT / chart), "--namespace", namespace,
                                    "--include-crds"], env)  # fmt: skip
                    assert "kind: CustomResourceDefinition" in out and "name: pagoda-operator" in out
                elif words[:2] in (["kubectl", "apply"], ["kubectl", "create"]):
                    extra = ["--validate=false"] if words[1] == "apply" else []  # the emulator has no OpenAPI
                    argv = [tool("kubectl"), *words[1:], *extra]
                    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in argv]
                    await sh(argv, env)
                elif words[:3] == ["kubectl", "get", "inferencedeployments"] and "-w" in words:
                    await make_ready(cluster, "smollm2-cpu")
                    await cluster.wait_for(
                        lambda: (
                            (cluster.get(INFD, "default", "smollm2-cpu").get("status") or {}).get("phase")
                            == "AllReplicasReady"
                        ),
                        what="AllReplicasReady",
                    )
                    out = await sh([tool("kubectl"), *[w for w in words[1:] if w != "-w"]], env)
                    [row] = [line for line in out.splitlines() if line.startswith("smollm2-cpu")]
                    assert "AllReplicasReady" in row.split(), out
                elif words[:2] == ["kubectl", "port-forward"]:
                    service = words[2].removeprefix("svc/")
                    sts = cluster.get(STS, "default", service)  # the Service selects these engine pods
                    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
                    port = free_port()
                    args = [str(port) if a == "8000" else "127.0.0.1" if a == "0.0.0.0" else a for a in args]
                    # the machine is shared: a small KV cache (the engine keeps the last value of a flag)
                    args += ["--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024"]
                    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115 - closed with the process
                    engine = subprocess.Popen([PAGODA, "serve", *args], stdout=log, stderr=subprocess.STDOUT)
                    for _ in range(3000):
                        assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                        try:
                            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        await asyncio.sleep(0.1)
                elif words[0] == "curl":
                    assert port is not None, "curl before port-forward"
                    argv = [w.replace("localhost:8000", f"127.0.0.1:{port}") for w in words]
                    answer = json.loads(await sh(argv, env))
                    assert "Paris" in answer["choices"][0]["message"]["content"], answer
                elif words[:2] == ["kubectl", "get"] and "jsonpath={.status.model}" in " ".join(
                    words
                ).replace("'", ""):
                    # a user runs it again until the download is done; the test waits for that first
                    await cluster.wait_for(
                        lambda name=words[3]: model_phase(cluster, name) == "Ready",
                        what="status.model.phase Ready",
                    )
                    out = await sh([tool("kubectl"), *words[1:]], env)
                    model = json.loads(out)
                    assert model["phase"] == "Ready" and model["source"].startswith("hf://"), model
                    assert "HF_TOKEN" not in out
                else:
                    raise AssertionError(f"the quickstart has a command this test does not run: {command}")
                ran.append(words[0] + " " + words[1])
            await cluster.settle()
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait(60)
    assert len(ran) == len(quickstart())
