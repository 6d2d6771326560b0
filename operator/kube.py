"""A small asyncio Kubernetes client: the handful of calls the reconciler makes, as JSON, over aiohttp.

It uses the credentials kopf logged in with (kopf.ConnectionInfo), so the operator has one identity.
Children are written whole (create, or replace with the resourceVersion last read), so a key the operator
stops rendering disappears; the status subresource takes JSON merge patches.
"""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp

# Where each kind the operator writes lives in the API.
RESOURCES: dict[str, tuple[str, str]] = {
    "StatefulSet": ("apis/apps/v1", "statefulsets"),
    "Service": ("api/v1", "services"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "ServiceMonitor": ("apis/monitoring.coreos.com/v1", "servicemonitors"),
    "InferenceDeployment": ("apis/pagoda.dev/v1alpha1", "inferencedeployments"),
    "Event": ("api/v1", "events"),
    "Pod": ("api/v1", "pods"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "HorizontalPodAutoscaler": ("apis/autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("apis/keda.sh/v1alpha1", "scaledobjects"),
    "InferencePool": ("apis/inference.networking.k8s.io/v1", "inferencepools"),
    "Job": ("apis/batch/v1", "jobs"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "LeaderWorkerSet": ("apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
}


def _to_file(data: str | bytes) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        return handle.name


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying with backoff: conflicts, throttling and server-side trouble."""
        return self.status in (409, 429) or self.status >= 500


def object_path(
    kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None
) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"/{prefix}/namespaces/{namespace}/{plural}" if namespace else f"/{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Kube:
    """JSON calls against one API server; create it inside the operator's event loop."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        ca_path: str | None = None,
        ca_data: str | bytes | None = None,
        insecure: bool = False,
        certificate_path: str | None = None,
        private_key_path: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "pagoda-operator"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        ssl_context: ssl.SSLContext | bool = True
        if self.server.startswith("https"):
            if insecure:
                ssl_context = False
            else:
                ssl_context = ssl.create_default_context(
                    cafile=ca_path, cadata=ca_data.decode() if isinstance(ca_data, bytes) else ca_data
                )
                if certificate_path and private_key_path:
                    ssl_context.load_cert_chain(certificate_path, private_key_path)
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=ssl_context, limit=32),
        )

    @classmethod
    def from_connection(cls, info: Any) -> Kube:
        """From a kopf.ConnectionInfo (what the login handler returned)."""
        cert, key = info.certificate_path, info.private_key_path
        if info.certificate_data and info.private_key_data:
            cert, key = _to_file(info.certificate_data), _to_file(info.private_key_data)
        return cls(
            info.server,
            token=info.token,
            ca_path=info.ca_path,
            ca_data=info.ca_data,
            insecure=bool(info.insecure),
            certificate_path=cert,
            private_key_path=key,
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, *, json: Any = None, content_type: str | None = None,
                    params: dict[str, str] | None = None) -> dict[str, Any] | None:  # fmt: skip
        headers = {"Content-Type": content_type} if content_type else None
        async with self._session.request(
            method, self.server + path, json=json, headers=headers, params=params
        ) as resp:
            if resp.status == 404 and method == "GET":
                return None
            body = await resp.text()
            if resp.status >= 400:
                try:
                    message = (await resp.json(content_type=None)).get("message", body)
                except Exception:
                    message = body
                raise ApiError(resp.status, str(message)[:500])
            return await resp.json(content_type=None) if body else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        return await self._call("GET", path)

    async def text(self, path: str, params: dict[str, str] | None = None) -> str:
        """A plain-text read (a pod's log); '' when it does not exist."""
        async with self._session.get(self.server + path, params=params, headers={"Accept": "*/*"}) as resp:
            if resp.status == 404:
                return ""
            body = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, body[:500])
            return body

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        """The items of a collection, optionally only those matching `label_selector`."""
        params = {"labelSelector": label_selector} if label_selector else None
        listing = await self._call("GET", path, params=params) or {}
        return list(listing.get("items") or [])

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, json=body) or {}

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT: the object becomes `body`; 409 when its metadata.resourceVersion is no longer current."""
        return await self._call("PUT", path, json=body) or {}

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("PATCH", path, json=body, content_type="application/merge-patch+json") or {}

    async def delete(self, path: str, *, orphan: bool = False) -> None:
        params = {"propagationPolicy": "Orphan"} if orphan else None
        try:
            await self._call("DELETE", path, params=params)
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def has_api(self, group_version: str) -> bool:
        """Whether the server serves `group/version` (e.g. monitoring.coreos.com/v1)."""
        try:
            return await self.get(f"/apis/{group_version}") is not None
        except ApiError:
            return False
