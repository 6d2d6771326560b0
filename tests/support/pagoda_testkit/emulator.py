"""kmock's Kubernetes emulator with the few API-server behaviours Pagoda's tests and benchmark rely on.

kmock keeps objects as plain JSON and leaves "special fields" to subclasses (its docstring says so). This
subclass adds what a real API server does and kubectl or the operator can observe:

- `metadata.uid`, `creationTimestamp`, `resourceVersion`, `generation` (bumped when `spec` changes) and
  names from `generateName` (kopf posts Events that way);
- a CustomResourceDefinition, once created, makes its resource discoverable (`/apis/<group>/<version>`);
- `Accept: application/json;as=Table` (what `kubectl get` asks for) answers a `meta.k8s.io/v1` Table
  using the CRD's `additionalPrinterColumns`;
- a Job is finished (succeeded) when it is created, unless `jobs_succeed` is turned off (no Job controller);
- PUT (a full replace, which kmock does not serve): the stored object becomes the body, keeping what the
  server owns (uid, creation time, status), and a `metadata.resourceVersion` that is not the current one
  is refused with 409 Conflict, as a real API server does for an update.

Test and benchmark helper only (it imports kmock, a dev dependency, and its private modules).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import functools
import itertools
import json
import re
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, rendering
from pagoda.operator.jsonpath import jsonpath_get

POD_LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
POD_PROXY = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/:]+):(\d+)/proxy(/.*)$")
JOBS = "batch/v1/jobs"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CRD_RESOURCE = "apiextensions.k8s.io/v1/customresourcedefinitions"
# The built-in resources every API server serves that Pagoda, kopf and kubectl touch.
BUILTINS = [
    (CRD_RESOURCE, "CustomResourceDefinition", False, {"status"}),
    ("v1/namespaces", "Namespace", False, {"status"}),
    ("v1/nodes", "Node", False, {"status"}),
    ("v1/events", "Event", True, set()),
    ("v1/services", "Service", True, {"status"}),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/secrets", "Secret", True, set()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, {"status"}),
    ("apps/v1/statefulsets", "StatefulSet", True, {"status", "scale"}),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, {"status"}),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("batch/v1/jobs", "Job", True, {"status"}),
]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


class _FastDispatch(kmock.RawHandler):
    """Serve plain object reads and writes without walking kmock's reaction DSL.

    kmock matches every request against every registered reaction, which costs tens of milliseconds per
    request on a busy machine; with no reactions of our own, the answer is always the emulator's default
    handler, so call it directly. Discovery and watch streams still take kmock's full path.
    """

    async def _handle(self, request: rendering.Request) -> Any:
        resource = request.resource
        if resource is None or resource.plural is None or "as=Table" in request.headers.get("Accept", ""):
            return await super()._handle(request)
        if request.action in (enums.action.FETCH, enums.action.UPDATE, enums.action.CREATE):
            # One dict lookup instead of kmock's scan over every stored object.
            name = request.name
            namespace = request.namespace
            if request.action == enums.action.CREATE:
                meta = (request.data or {}).get("metadata", {})
                name, namespace = meta.get("name"), namespace or meta.get("namespace")
            obj = self.objects._objects.get((resource, namespace, name))
            if obj is None or (obj.deleted and request.action == enums.action.FETCH):
                raise kmock.KubernetesObjectNotFoundError()
            return aiohttp.web.json_response(obj.last.raw)
        handler = {
            enums.action.LIST: self._serve_list,
            enums.action.DELETE: self._serve_delete,
        }.get(request.action)
        if handler is None:
            return await super()._handle(request)
        return aiohttp.web.json_response(await handler(request))


@attrs.define(kw_only=True)
class PagodaEmulator(kmock.KubernetesEmulator, _FastDispatch):
    """The emulator plus object metadata, CRD registration and server-side Table printing."""

    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    # GET through the API server's pod proxy: (namespace, pod, port, path) -> the JSON the pod answers.
    pod_proxy: dict[tuple[str, str, int, str], Any] = attrs.field(factory=dict, init=False)
    # GET .../pods/NAME/log: (namespace, pod) -> the log text the kubelet would return.
    pod_logs: dict[tuple[str, str], str] = attrs.field(factory=dict, init=False)
    # No Job controller runs here: a created Job is finished at once (succeeded), as a model download that
    # found its files in the cache would be. Tests of the download itself turn this off and write the
    # Job's status themselves.
    jobs_succeed: bool = attrs.field(default=True, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        for resource, kind, namespaced, subresources in BUILTINS:
            self.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                verbs=verbs,
                subresources=subresources,
                singular=kind.lower(),
            )

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8 cannot parse the cluster-wide namespace list (GET /api/v1/namespaces: its path parser
        # fails and it answers 500, which kopf retries forever). Serve it here: the stored Namespaces, and a
        # watch that stays open (namespaces come and go rarely in a test).
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            # kubectl sends built-in objects as protobuf (`kubectl create secret`): read the one kind the
            # tests create that way, answer in JSON (kubectl accepts both).
            headers = {**raw_request.headers, "Content-Type": "application/json"}
            raw_request = raw_request.clone(headers=headers)
            secret = _secret_from_protobuf(await raw_request.read())
            if secret is None:
                return aiohttp.web.json_response(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "UnsupportedMediaType",
                     "code": 415, "message": "this emulator reads protobuf Secrets only"}, status=415)  # fmt: skip
            raw_request._read_bytes = json.dumps(secret).encode()
        logged = POD_LOG.match(raw_request.path)
        if logged and raw_request.method == "GET":
            await raw_request.read()
            text = self.pod_logs.get(logged.groups())
            if text is None:
                return aiohttp.web.json_response({"message": "no such pod"}, status=404)
            tail = raw_request.query.get("tailLines")
            lines = text.splitlines()[-int(tail) :] if tail else text.splitlines()
            return aiohttp.web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
        proxied = POD_PROXY.match(raw_request.path)
        if proxied and raw_request.method == "GET":
            await raw_request.read()
            ns, pod, port, path = proxied.groups()
            key = (ns, pod, int(port), path)
            if key not in self.pod_proxy:
                return aiohttp.web.json_response({"message": "no endpoint"}, status=503)
            return aiohttp.web.json_response(self.pod_proxy[key])
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            await raw_request.read()
            if raw_request.query.get("watch") == "true":
                response = aiohttp.web.StreamResponse()
                await response.prepare(raw_request)
                while True:
                    await asyncio.sleep(3600)
            items = [
                obj.raw
                for (res, _, _), obj in list(self.objects.items())
                if res == "v1/namespaces" and not obj.deleted
            ]
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "NamespaceList",
                    "metadata": {"resourceVersion": "1"},
                    "items": items,
                }
            )
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.method == enums.method.PUT and request.resource is not None and request.name:
            return aiohttp.web.json_response(await self._replace(request))
        if request.resource is not None and isinstance(request.data, dict):
            data = request.data
            meta = data.setdefault("metadata", {}) if request.action == enums.action.CREATE else None
            if request.action == enums.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                meta["resourceVersion"] = str(next(self._rv))
                meta.setdefault("generation", 1)
                if self.jobs_succeed and request.resource == _resource(JOBS) and not data.get("status"):
                    data["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
                if request.resource == CRD_RESOURCE:
                    self._register_crd(data)
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                patch_meta = data.setdefault("metadata", {})
                if isinstance(patch_meta, dict):
                    patch_meta["resourceVersion"] = str(next(self._rv))
                    if key in self.objects and not self.objects[key].deleted and not request.subresource:
                        current = self.objects[key].raw
                        if "spec" in data and _merge(current.get("spec"), data["spec"]) != current.get(
                            "spec"
                        ):
                            patch_meta["generation"] = (
                                int(current.get("metadata", {}).get("generation", 1)) + 1
                            )
        return await super()._handle(request)

    async def _replace(self, request: rendering.Request) -> dict[str, Any]:
        """PUT: replace the object (or its status), checking the resourceVersion the client last saw."""
        data = request.data
        if not isinstance(data, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body must be an object")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            current = copy.deepcopy(self.objects[key].raw)
            old_meta = current.get("metadata", {})
            meta = data.get("metadata") or {}
            if meta.get("name", request.name) != request.name:
                raise kmock.KubernetesError(
                    status=400, reason="BadRequest", message="metadata.name does not match the URL"
                )
            wanted = meta.get("resourceVersion")
            if wanted and wanted != old_meta.get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=f"Operation cannot be fulfilled on {request.resource.plural} {request.name!r}: the "
                    "object has been modified; please apply your changes to the latest version and try again",
                )
            if request.subresource == "status":
                new = {**current, "status": data.get("status")}
            else:
                new = {k: v for k, v in data.items() if k != "status"}
                if "status" in current:
                    new["status"] = current["status"]
                kept = ("uid", "creationTimestamp", "deletionTimestamp", "generation", "namespace", "name")
                new["metadata"] = {**meta, **{k: old_meta[k] for k in kept if k in old_meta}}
                if new.get("spec") != current.get("spec"):
                    new["metadata"]["generation"] = int(old_meta.get("generation", 1)) + 1
            new.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))
            self.objects[key].create(new)
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
            return raw

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            subresources = set(version.get("subresources") or {})
            self.resources[f"{spec.get('group')}/{version['name']}/{names.get('plural')}"] = (
                kmock.ResourceInfo(
                    kind=names.get("kind"),
                    singular=names.get("singular"),
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    shortnames=set(names.get("shortNames") or []),
                    categories=set(names.get("categories") or []),
                    subresources=subresources,
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
                )
            )

    async def _serve_version(self, request: rendering.Request) -> Any:
        # kmock repeats a resource's short names on its subresources; a real server does not, and
        # kubectl then warns that `infd` is ambiguous.
        result = await super()._serve_version(request)
        for entry in result.get("resources", []):
            if "/" in entry["name"]:
                entry["shortNames"], entry["categories"] = [], []
        return result

    def _printer_columns(self, request: rendering.Request) -> list[dict[str, Any]]:
        resource = request.resource
        for (res, _, _), obj in list(self.objects.items()):
            if res != CRD_RESOURCE or obj.deleted:
                continue
            spec = obj.raw.get("spec", {})
            if spec.get("group") != resource.group or spec.get("names", {}).get("plural") != resource.plural:
                continue
            for version in spec.get("versions", []):
                if version.get("name") == resource.version:
                    return [c for c in version.get("additionalPrinterColumns", []) if c["name"] != "Age"]
        return []

    def _table(self, request: rendering.Request, items: list[dict[str, Any]]) -> dict[str, Any]:
        columns = self._printer_columns(request)
        definitions = [{"name": "Name", "type": "string", "format": "name", "description": "Name"}]
        definitions += [
            {"name": c["name"], "type": c.get("type", "string"), "format": "", "description": ""}
            for c in columns
        ]
        definitions.append({"name": "Age", "type": "date", "format": "", "description": "Age"})
        rows = []
        for item in items:
            meta = item.get("metadata", {})
            cells = [meta.get("name")]
            cells += [jsonpath_get(item, c["jsonPath"]) for c in columns]
            cells.append(_age(meta.get("creationTimestamp")))
            partial = {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": meta}
            rows.append({"cells": cells, "object": partial})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        if self._wants_table(request):
            return self._table(request, result["items"])
        return result

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        result = await super()._serve_fetch(request)
        if self._wants_table(request):
            return self._table(request, [result])
        return result

    def writes(self, since: int = 0) -> list[rendering.Request]:
        """Write requests (POST, PUT, PATCH, DELETE) received from request number `since` on."""
        return [
            r for r in list(self._requests)[since:] if str(r.method).upper().split(".")[-1] in WRITE_METHODS
        ]

    @property
    def request_count(self) -> int:
        return len(self._requests)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (_resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw


def _fields(data: bytes) -> dict[int, list[Any]]:
    """Protocol buffers' wire format: field number -> values (ints for varints, bytes otherwise)."""
    out: dict[int, list[Any]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 2:
            size = varint()
            value, i = data[i : i + size], i + size
        elif wire == 1:
            value, i = data[i : i + 8], i + 8
        elif wire == 5:
            value, i = data[i : i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _secret_from_protobuf(body: bytes) -> dict[str, Any] | None:
    """A v1 Secret in Kubernetes' protobuf envelope (`k8s\\0` + runtime.Unknown) as JSON; None otherwise."""
    if not body.startswith(b"k8s\x00"):
        return None
    unknown = _fields(body[4:])
    type_meta = _fields(unknown.get(1, [b""])[0])
    if type_meta.get(2, [b""])[0] != b"Secret":
        return None
    raw = _fields(unknown.get(2, [b""])[0])
    meta = _fields(raw.get(1, [b""])[0])
    text = {1: "name", 2: "generateName", 3: "namespace"}
    metadata = {k: meta[n][0].decode() for n, k in text.items() if n in meta}
    data = {}
    for entry in raw.get(2, []):
        kv = _fields(entry)
        data[kv[1][0].decode()] = base64.b64encode(kv.get(2, [b""])[0]).decode()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "data": data}
    if 3 in raw:
        secret["type"] = raw[3][0].decode()
    return secret


@functools.lru_cache(maxsize=64)
def _resource(text: str) -> kmock.resource:
    return kmock.resource(text)


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    created = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - created).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"
