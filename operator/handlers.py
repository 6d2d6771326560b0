"""kopf wiring: which events reconcile which InferenceDeployment. The work itself is in reconcile.py.

- InferenceDeployment created, changed, or seen at operator start-up: reconcile it.
- A managed StatefulSet or LeaderWorkerSet changed (hand edit, deletion, pods becoming ready): reconcile its
  owner. (kopf watches leaderworkersets once LeaderWorkerSet's CRD is served.)
- An engine pod ran out of memory (OOMKilled, or the engine's exit code 3): re-fit its owner (refit.py).
- An engine pod of a new image became Ready: compare its measured memory with the plan (profile.py).
- A model download Job changed (started, finished, failed): reconcile its owner; while a download runs, its
  owner is reconciled again every 15 s to read the progress from the pod's log.
- The GPU inventory on the nodes changed (a GPU node appears, goes away, changes product): reconcile all,
  so a deployment waiting for an L40S gets one as soon as an L40S node joins.

kopf indexes the nodes before any handler runs, so the first reconcile already sees every GPU.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
from pagoda.operator import model_cache, render
from pagoda.operator.discovery import NodeGPUs, node_gpus
from pagoda.operator.kube import ApiError, Kube
from pagoda.operator.metrics import DEFAULT, OperatorMetrics
from pagoda.operator.reconcile import LWS_NOT_SERVED, MONITORING_TTL, Reconciler
from pagoda.operator.refit import failure_of

log = logging.getLogger("pagoda.operator")
CR = (render.GROUP, render.VERSION, render.PLURAL)
DOWNLOAD_POLL_SECONDS = 15.0  # how often a running download's progress is read into status.model


@dataclass
class OperatorState:
    """What one running operator keeps: its API client, reconciler and the node inventory it acted on."""

    connection: kopf.ConnectionInfo | None = None  # fixed credentials (tests); None = kopf's usual login
    reconciler: Reconciler | None = None
    connection_used: kopf.ConnectionInfo | None = None  # what the login handler returned
    inventory: frozenset[NodeGPUs] | None = None
    namespaces: list[str] = field(default_factory=list)  # empty = cluster-wide
    metrics: OperatorMetrics = DEFAULT
    allowed_images: tuple[str, ...] = ()  # spec.image allow-list; empty allows any
    followers: dict[tuple[str, str], asyncio.Task] = field(default_factory=dict)  # downloads being followed


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in body.items()}


def _nodes(index: Any) -> list[NodeGPUs]:
    return [gpus for store in index.values() for gpus in store]


def _retry(exc: ApiError) -> kopf.TemporaryError:
    return kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5 if exc.status == 409 else 15)


def build_registry(state: OperatorState) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # our own Events say what happened; no "handler succeeded"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pagoda.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="pagoda.dev", key="last-handled-configuration"
        )
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.error_backoffs = [1, 2, 5, 10, 20]
        settings.queueing.worker_limit = 64

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = state.connection or _default_login(**kwargs)
        state.connection_used = info
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        for task in state.followers.values():
            task.cancel()
        state.followers.clear()
        if state.reconciler is not None:
            await state.reconciler.kube.close()
            state.reconciler = None

    def reconciler() -> Reconciler:
        if state.reconciler is None:
            state.reconciler = Reconciler(
                Kube.from_connection(state.connection_used), state.metrics, state.allowed_images
            )
        return state.reconciler

    @kopf.index("", "v1", "nodes", id="gpu_nodes", registry=registry)
    def gpu_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, NodeGPUs] | None:
        gpus = node_gpus(dict(body))
        return {name: gpus} if gpus is not None else None

    async def reconcile(namespace: str, name: str, index: Any, body: dict[str, Any] | None = None) -> None:
        try:
            outcome = await reconciler().reconcile(namespace, name, _nodes(index), body)
        except ApiError as exc:
            if exc.transient:
                raise _retry(exc) from None
            raise
        if outcome is not None and (outcome.status or {}).get("phase") == "Downloading":
            follow_download(namespace, name, index)
        elif outcome is not None and outcome.error is not None and outcome.error.reason == LWS_NOT_SERVED:
            # no event says that LeaderWorkerSet got installed: look again once the API answer expires
            follow_download(namespace, name, index, MONITORING_TTL)

    def follow_download(namespace: str, name: str, index: Any, delay: float = DOWNLOAD_POLL_SECONDS) -> None:
        """Reconcile again in a while (one pending call per object): the download's progress is in its
        pod's log, which no watch event announces (nor the arrival of an API a deployment waits for)."""
        key = (namespace, name)
        if key in state.followers and not state.followers[key].done():
            return

        async def later() -> None:
            await asyncio.sleep(delay)
            state.followers.pop(key, None)
            try:
                await reconcile(namespace, name, index)
            except Exception as exc:  # the next event or follow-up tries again
                log.warning("reading the download progress of %s/%s failed: %s", namespace, name, exc)

        state.followers[key] = asyncio.get_running_loop().create_task(later())

    @kopf.on.resume(*CR, id="reconcile", backoff=10, registry=registry)
    @kopf.on.create(*CR, id="reconcile", backoff=10, registry=registry)
    @kopf.on.update(*CR, id="reconcile", backoff=10, registry=registry)
    async def inference_deployment(
        namespace: str, name: str, body: kopf.Body, gpu_nodes: Any, **_: Any
    ) -> None:
        await reconcile(namespace, name, gpu_nodes, _plain(body))

    @kopf.on.delete(*CR, id="forget", registry=registry, optional=True)
    def forget(namespace: str, name: str, **_: Any) -> None:
        # Children go with their owner (ownerReferences); only the metrics need to let go.
        if state.reconciler is not None:
            state.reconciler.forget(namespace, name)

    @kopf.on.event(
        "apps",
        "v1",
        "statefulsets",
        labels={render.LABEL_MANAGED: render.MANAGED_BY},
        id="statefulset",
        registry=registry,
    )
    async def statefulset(
        event: dict[str, Any], body: kopf.Body, namespace: str, gpu_nodes: Any, **_: Any
    ) -> None:
        meta = body.get("metadata", {})
        owner = (meta.get("labels") or {}).get(render.LABEL_OWNER)
        if state.reconciler is not None and event.get("type") != "DELETED":
            if state.reconciler.own_write(namespace, meta.get("name"), meta.get("resourceVersion")):
                return  # the echo of our own write: nothing drifted
        if owner and event.get("type") is not None:
            await reconcile(namespace, owner, gpu_nodes)

    @kopf.on.event(
        "leaderworkerset.x-k8s.io",
        "v1",
        "leaderworkersets",
        labels={render.LABEL_MANAGED: render.MANAGED_BY},
        id="leaderworkerset",
        registry=registry,
    )
    async def leaderworkerset(
        event: dict[str, Any], body: kopf.Body, namespace: str, gpu_nodes: Any, **_: Any
    ) -> None:
        # as a StatefulSet's: a group set edited or deleted by hand is put back, its readiness reported
        await statefulset(event=event, body=body, namespace=namespace, gpu_nodes=gpu_nodes)

    @kopf.on.event(
        "batch", "v1", "jobs", labels={render.LABEL_MANAGED: render.MANAGED_BY}, id="jobs", registry=registry
    )
    async def job(event: dict[str, Any], body: kopf.Body, namespace: str, gpu_nodes: Any, **_: Any) -> None:
        # A model download started, progressed, finished or failed: its owner's status and children follow.
        owner = (body.get("metadata", {}).get("labels") or {}).get(render.LABEL_OWNER)
        if owner and event.get("type") is not None:
            await reconcile(namespace, owner, gpu_nodes)

    @kopf.on.event(
        "", "v1", "pods", labels={render.LABEL_MANAGED: render.MANAGED_BY}, id="pods", registry=registry
    )
    async def pod(body: kopf.Body, namespace: str, gpu_nodes: Any, **_: Any) -> None:
        # An engine that ran out of memory (OOMKilled, or exit code 3 at start-up): re-fit its deployment.
        labels = body.get("metadata", {}).get("labels") or {}
        owner = labels.get(render.LABEL_OWNER)
        if not owner or labels.get(model_cache.COMPONENT_LABEL) == model_cache.COMPONENT:
            return  # download pods report through their Job
        failure = failure_of(dict(body), render.PLAN_ANNOTATION)
        try:
            if failure is not None:
                await reconciler().reconcile(namespace, owner, _nodes(gpu_nodes), failure=failure)
            else:
                # A Ready engine of a new image: does it measure the memory the plan assumed? (profile.py)
                await reconciler().check_profile(namespace, owner, _nodes(gpu_nodes), dict(body))
        except ApiError as exc:
            if exc.transient:
                raise _retry(exc) from None
            raise

    @kopf.on.event("", "v1", "nodes", id="nodes", registry=registry)
    async def node(gpu_nodes: Any, **_: Any) -> None:
        inventory = frozenset(_nodes(gpu_nodes))
        if state.inventory is None or inventory == state.inventory:
            state.inventory = inventory
            return
        state.inventory = inventory
        log.info(
            "GPU inventory changed (%d GPU nodes): re-planning every InferenceDeployment", len(inventory)
        )
        await replan_all(gpu_nodes)

    async def replan_all(index: Any) -> None:
        rec = reconciler()
        namespaces = state.namespaces or [None]
        for ns in namespaces:
            path = f"/apis/{render.API_VERSION}" + (f"/namespaces/{ns}" if ns else "") + f"/{render.PLURAL}"
            listing = await rec.kube.get(path) or {}
            for item in listing.get("items", []):
                meta = item.get("metadata", {})
                try:
                    await rec.reconcile(meta.get("namespace"), meta["name"], _nodes(index))
                except Exception as exc:  # one object's trouble must not stop the others
                    log.warning("re-planning %s/%s failed: %s", meta.get("namespace"), meta.get("name"), exc)

    return registry


def _default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig — kopf's own login helpers, in that order."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    return info
