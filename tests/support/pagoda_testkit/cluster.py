"""Test kit: kmock's emulator (with Pagoda's extension) as a cluster with GFD-labelled Nodes, and the operator
running under kopf in the same event loop. For the tests and the benchmark only (it imports kmock, a dev
dependency, and finds crds/ and examples/ in the checkout), so it lives under tests/, not in the package."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import kmock
import kopf
import yaml
from pagoda.operator.runner import OperatorConfig, run

from pagoda_testkit.emulator import PagodaEmulator

ROOT = pathlib.Path(__file__).resolve().parents[3]  # the repository (this is tests/support/pagoda_testkit/)
CRD_FILE = ROOT / "crds" / "pagoda.dev_inferencedeployments.yaml"
EXAMPLES = ROOT / "examples"
INFD = "pagoda.dev/v1alpha1/inferencedeployments"
STS = "apps/v1/statefulsets"

# Labels as GPU Feature Discovery writes them (REFERENCE.md): product, memory in MiB, count, compute capability.
GPU_NODES: dict[str, dict[str, str]] = {
    "h100": {
        "product": "NVIDIA-H100-80GB-HBM3",
        "memory": "81559",
        "count": "8",
        "major": "9",
        "minor": "0",
        "family": "hopper",
    },
    "l4": {
        "product": "NVIDIA-L4",
        "memory": "23034",
        "count": "4",
        "major": "8",
        "minor": "9",
        "family": "ada-lovelace",
    },
    "a100": {
        "product": "NVIDIA-A100-SXM4-80GB",
        "memory": "81920",
        "count": "8",
        "major": "8",
        "minor": "0",
        "family": "ampere",
    },
    "v100": {  # Volta: the engine image's torch build cannot run it
        "product": "Tesla-V100-SXM2-32GB",
        "memory": "32510",
        "count": "8",
        "major": "7",
        "minor": "0",
        "family": "volta",
    },
    "l40s": {
        "product": "NVIDIA-L40S",
        "memory": "46068",
        "count": "4",
        "major": "8",
        "minor": "9",
        "family": "ada-lovelace",
    },
}


def node(name: str, kind: str | None) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    allocatable = {"cpu": "32", "memory": "256Gi"}
    if kind:
        g = GPU_NODES[kind]
        labels |= {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": g["product"],
            "nvidia.com/gpu.memory": g["memory"],
            "nvidia.com/gpu.count": g["count"],
            "nvidia.com/gpu.compute.major": g["major"],
            "nvidia.com/gpu.compute.minor": g["minor"],
            "nvidia.com/gpu.family": g["family"],
        }
        allocatable["nvidia.com/gpu"] = g["count"]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {},
        "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def pod_of(sts: dict[str, Any], n: int, *, ready: bool, container_status: dict[str, Any]) -> dict[str, Any]:
    """A pod of this StatefulSet's current template as the kubelet reports it: its `n`th, with the engine
    container's status `container_status` (ready, restart count, state...)."""
    template = sts["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{sts['metadata']['name']}-{n}",
            "namespace": sts["metadata"].get("namespace", "default"),
            "labels": dict(template["metadata"]["labels"]),
            "annotations": dict(template["metadata"]["annotations"]),
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "engine", "ready": ready, **container_status}],
        },
    }


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


class Cluster:
    """The emulator plus the calls a test makes as a user would (over HTTP, like kubectl)."""

    def __init__(self, emulator: PagodaEmulator, url: str, session: aiohttp.ClientSession) -> None:
        self.emulator = emulator
        self.url = url.rstrip("/")
        self.session = session

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else None
        async with self.session.request(method, self.url + path, json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            assert resp.status < 400, f"{method} {path}: {resp.status} {data}"
            return data

    async def add_node(self, name: str, kind: str | None) -> None:
        await self._call("POST", "/api/v1/nodes", node(name, kind))

    async def delete_node(self, name: str) -> None:
        await self._call("DELETE", f"/api/v1/nodes/{name}")

    async def create(self, obj: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("namespace", namespace)
        return await self._call(
            "POST", f"/apis/pagoda.dev/v1alpha1/namespaces/{namespace}/inferencedeployments", obj
        )

    async def patch(self, resource: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        group = "api/v1" if resource.startswith("v1/") else f"apis/{resource.rsplit('/', 1)[0]}"
        plural = resource.rsplit("/", 1)[1]
        return await self._call("PATCH", f"/{group}/namespaces/{namespace}/{plural}/{name}", patch)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.emulator.get(resource, namespace, name)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (res, ns, _), obj in list(self.emulator.objects.items())
            if res == resource and not obj.deleted and (namespace is None or ns == namespace)
        ]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.objects("v1/events") if e.get("involvedObject", {}).get("name") == name]

    async def wait_for(self, check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.05)

    async def settle(self, quiet: float = 0.6, timeout: float = 15.0) -> None:
        """Wait until no request has arrived for `quiet` seconds (the operator is idle)."""
        deadline = time.monotonic() + timeout
        last, since = self.emulator.request_count, time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if self.emulator.request_count != last:
                last, since = self.emulator.request_count, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
        raise AssertionError("the operator never went quiet")

    def condition(self, name: str, kind: str, namespace: str = "default") -> dict[str, Any]:
        obj = self.get(INFD, namespace, name) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == kind:
                return cond
        return {}


@contextlib.asynccontextmanager
async def emulated_cluster() -> AsyncIterator[Cluster]:
    """An emulated API server on a free port with the InferenceDeployment CRD applied."""
    async with PagodaEmulator() as emulator, kmock.Server(emulator) as server:
        async with aiohttp.ClientSession() as session:
            c = Cluster(emulator, str(server.url), session)
            crd = yaml.safe_load(CRD_FILE.read_text())
            await c._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            yield c


class ClusterThread:
    """An emulated cluster on its own thread and event loop, for tests that drive real processes against it.

    `populate(cluster)` adds nodes and objects before `with ClusterThread(populate) as c:` returns; `c.url`
    is the API server's address.
    """

    def __init__(self, populate: Callable[[Cluster], Awaitable[None]]) -> None:
        self.populate = populate
        self.url: str | None = None
        self.cluster: Cluster | None = None  # read it from other threads only to poll objects
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._run())
        except BaseException as exc:  # handed to the test in __enter__
            self.error = exc
            self.ready.set()

    async def _run(self) -> None:
        self.stop = asyncio.Event()
        async with emulated_cluster() as cluster:
            await self.populate(cluster)
            self.url, self.cluster = cluster.url, cluster
            self.ready.set()
            await self.stop.wait()

    def __enter__(self) -> ClusterThread:
        self.thread.start()
        assert self.ready.wait(60), "the emulated cluster never started"
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def kubeconfig(url: str) -> dict[str, Any]:
    """A kubeconfig for a process outside the test (the operator's entrypoint) to reach the emulator at ``url``."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "emu", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
        "current-context": "emu",
    }


def chart_operator_args(metrics_port: int, health_port: int) -> list[str]:
    """The operator container's args as the Helm chart renders them (real helm), with the metrics and liveness
    ports replaced."""
    import shutil
    import subprocess

    helm = ROOT / ".tools" / "bin" / "helm"
    helm_path = str(helm) if helm.exists() else shutil.which("helm")
    if not helm_path:
        raise RuntimeError("helm not found: run `make install`")
    out = subprocess.run(
        [helm_path, "template", "pagoda", str(ROOT / "charts" / "pagoda"), "-s", "templates/deployment.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    args = yaml.safe_load(out)["spec"]["template"]["spec"]["containers"][0]["args"]
    replace = {
        "--metrics-port=": f"--metrics-port={metrics_port}",
        "--liveness=": f"--liveness=http://127.0.0.1:{health_port}/healthz",
    }
    assert set(replace) <= {a.split("=")[0] + "=" for a in args}, args
    return [next((new for old, new in replace.items() if a.startswith(old)), a) for a in args]


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, **options: Any) -> AsyncIterator[asyncio.Task]:
    """The operator under kopf, in this event loop, talking HTTP to the emulator; stopped on exit."""
    config = OperatorConfig(
        standalone=True,
        connection=kopf.ConnectionInfo(
            server=cluster.url, scheme="Bearer", token="test-token", insecure=True
        ),
        **options,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(config, stop_flag=stop, ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield task
        assert not task.done(), f"the operator exited: {task}"
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
