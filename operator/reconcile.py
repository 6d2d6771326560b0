"""One reconcile of one InferenceDeployment: plan, apply the children, write the status — writing nothing
when nothing changed.

Reads are cheap, writes are not: every child is fetched and compared with what it should be (the hash
annotation plus a field-by-field check that catches hand edits), and only a difference is written. A write
replaces the whole child (PUT with the resourceVersion just read), never merges into it: a key the operator
stops rendering (a GPU nodeSelector after a switch to CPU) must leave the live object, and a concurrent
writer gets a 409 and a retry rather than a silent mix of both versions.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.operator import model_cache, render
from pagoda.operator import profile as profiling
from pagoda.operator import refit as refitting
from pagoda.operator.contract import check_engine_commands, check_router_args
from pagoda.operator.discovery import (
    INFERENCE_POOL_API,
    KEDA_API,
    LWS_API,
    PROMETHEUS_OPERATOR_API,
    NodeGPUs,
    pools,
)
from pagoda.operator.images import check_image
from pagoda.operator.kube import ApiError, Kube, object_path
from pagoda.operator.metrics import DEFAULT, OperatorMetrics
from pagoda.operator.planning import decide, decide_on_nodes
from pagoda.operator.refit import Failure
from pagoda.operator.spec import SpecError, parse_spec
from pagoda.operator.status import (
    GATEWAY_NOT_SERVED,
    condition,
    error_status,
    failed_status,
    merge_patch,
    model_waiting_status,
    ready_status,
)

log = logging.getLogger("pagoda.operator")

# StatefulSet fields the API server refuses to change: a change means delete (orphaning pods) and create.
IMMUTABLE_STS = ("selector", "serviceName", "podManagementPolicy", "volumeClaimTemplates")
MONITORING_TTL = 60.0
# Maps the operator renders whole: a key someone adds there is drift (elsewhere the server adds defaults).
OWNED_MAPS = (("spec", "template", "spec", "nodeSelector"),)
# The kinds that run engine pods: what status counts replicas from, and whose events may echo our writes.
ENGINE_KINDS = ("StatefulSet", "LeaderWorkerSet")
LWS_NOT_SERVED = "LeaderWorkerSetNotServed"
# Fields the API server fills in and a replace must carry over (immutable once set).
SERVER_FILLED = {"Service": ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy")}


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field we set has our value in the live object (server defaults may add more)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return desired == live


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj or None


def in_sync(desired: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether `live` is what the operator rendered: same hash, our values, no extra keys in maps we own."""
    meta = desired["metadata"]
    live_hash = (live.get("metadata", {}).get("annotations") or {}).get(render.HASH_ANNOTATION)
    return (
        live_hash == meta["annotations"][render.HASH_ANNOTATION]
        and is_subset(desired["spec"], live.get("spec"))
        and is_subset(meta, live.get("metadata"))
        and all(_at(desired, path) == _at(live, path) for path in OWNED_MAPS)
    )


def _engine_image(pod: dict[str, Any]) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == refitting.ENGINE_CONTAINER:
            return container.get("image")
    return None


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def replacement(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """`desired` as a whole replacement for `live`: with the resourceVersion read (a concurrent write then
    fails with 409 instead of being lost), other controllers' finalizers and the fields the server filled."""
    body = copy.deepcopy(desired)
    live_meta = live.get("metadata") or {}
    if live_meta.get("resourceVersion"):
        body["metadata"]["resourceVersion"] = live_meta["resourceVersion"]
    if live_meta.get("finalizers"):
        body["metadata"]["finalizers"] = list(live_meta["finalizers"])
    live_spec = live.get("spec") or {}
    for key in SERVER_FILLED.get(desired["kind"], ()):
        if key not in body["spec"] and key in live_spec:
            body["spec"][key] = copy.deepcopy(live_spec[key])
    return body


def combined_status(engines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One engine set's view of the live engines (the StatefulSet, the LeaderWorkerSet, whose replicas are
    groups, or both pools summed): what status reports and Ready waits for."""
    if len(engines) <= 1:
        return engines[0] if engines else None
    total: dict[str, int] = {}
    rolled_out = True
    for live in engines:
        st = live.get("status") or {}
        for key in ("replicas", "readyReplicas", "updatedReplicas"):
            total[key] = total.get(key, 0) + int(st.get(key) or 0)
        generation = (live.get("metadata") or {}).get("generation")
        rolled_out &= generation is None or st.get("observedGeneration") == generation
    return {"metadata": {"generation": 1}, "status": {**total, "observedGeneration": 1 if rolled_out else 0}}


def lws_missing_message(decision: Any) -> str:
    return (
        f"a replica spans {decision.nnodes} pods ({decision.parallel_reason}), which the operator runs as a "
        f"LeaderWorkerSet, but the cluster does not serve {LWS_API}: install LeaderWorkerSet "
        "(https://github.com/kubernetes-sigs/lws); no engine pod is created until it is served"
    )


@dataclass
class Outcome:
    writes: list[str] = field(default_factory=list)  # what was written, in words
    error: SpecError | None = None
    status: dict[str, Any] | None = None


class Reconciler:
    """Reconciles InferenceDeployments; one at a time per object, any number of objects at once."""

    def __init__(
        self, kube: Kube, metrics: OperatorMetrics = DEFAULT, allowed_images: Sequence[str] = ()
    ) -> None:
        self.kube = kube
        self.metrics = metrics
        self.allowed_images = tuple(allowed_images)  # empty: any spec.image
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._apis: dict[str, tuple[bool, float]] = {}  # group/version -> (served, until when we trust it)
        self.plan_images: dict[tuple[str, str], str] = {}  # status.planImage as last written or read
        self.conditions: dict[tuple[str, str], dict[str, str]] = {}
        self.gpus: dict[tuple[str, str], tuple[str, int]] = {}
        self._written: dict[tuple[str, str], str] = {}  # StatefulSet -> resourceVersion of our last write

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self._locks.pop(key, None)
        self.conditions.pop(key, None)
        self.gpus.pop(key, None)
        self.plan_images.pop(key, None)
        self.metrics.publish(self.conditions, self.gpus)

    async def _api_available(self, group_version: str) -> bool:
        now = time.monotonic()
        cached = self._apis.get(group_version)
        if cached is None or cached[1] < now:
            cached = self._apis[group_version] = (
                await self.kube.has_api(group_version),
                now + MONITORING_TTL,
            )
        return cached[0]

    async def monitoring_available(self) -> bool:
        """Whether the Prometheus Operator's CRDs are served (then a ServiceMonitor is rendered)."""
        return await self._api_available(PROMETHEUS_OPERATOR_API)

    async def keda_available(self) -> bool:
        """Whether KEDA's CRDs are served (then autoscaling renders a ScaledObject instead of an HPA)."""
        return await self._api_available(KEDA_API)

    async def lws_available(self) -> bool:
        """Whether LeaderWorkerSet's API is served (a replica spanning nodes needs it)."""
        return await self._api_available(LWS_API)

    async def gateway_available(self) -> bool:
        """Whether the Gateway API Inference Extension's InferencePool is served (spec.gateway renders then)."""
        return await self._api_available(INFERENCE_POOL_API)

    def own_write(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether a StatefulSet event only echoes a write this operator made (nothing to correct)."""
        return resource_version is not None and self._written.get((namespace, name)) == resource_version

    async def reconcile(
        self,
        namespace: str,
        name: str,
        nodes: Iterable[NodeGPUs],
        body: dict[str, Any] | None = None,
        failure: Failure | None = None,
    ) -> Outcome | None:
        """Bring one InferenceDeployment's children and status in line; None if it no longer exists (or a
        pod `failure` needs nothing done).

        `body` may be passed for an object never reconciled (no status yet); otherwise it is read fresh, as
        another reconcile may have written its status since the caller saw it. With `failure` (an engine of
        this deployment ran out of memory), the plan is re-fitted first (refit.py).
        """
        async with self._lock((namespace, name)):
            started = time.perf_counter()
            try:
                if body is None or body.get("status") or failure is not None:
                    body = await self.kube.get(object_path("InferenceDeployment", namespace, name))
                if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                    return None
                if failure is not None:
                    outcome = await self._refit(body, list(nodes), failure)
                    if outcome is None:
                        return None
                else:
                    outcome = await self._reconcile(body, list(nodes))
            except ApiError as exc:
                self.metrics.reconciles.labels("error").inc()
                self.metrics.reconcile_errors.labels(f"http_{exc.status}").inc()
                raise
            except Exception as exc:
                self.metrics.reconciles.labels("error").inc()
                self.metrics.reconcile_errors.labels(type(exc).__name__).inc()
                raise
            finally:
                self.metrics.reconcile_duration.observe(time.perf_counter() - started)
            self.metrics.reconciles.labels("success").inc()
            if outcome.error is not None:
                self.metrics.reconcile_errors.labels(outcome.error.reason).inc()
            self._publish(namespace, name, body, outcome)
            return outcome

    def _publish(self, namespace: str, name: str, body: dict[str, Any], outcome: Outcome) -> None:
        """Remember what an outcome's status says (conditions and GPUs for the metrics, the plan's image)."""
        if outcome.status is None:
            return
        key = (namespace, name)
        if outcome.status.get("planImage"):
            self.plan_images[key] = outcome.status["planImage"]
        self.conditions[key] = {c["type"]: c["status"] for c in outcome.status.get("conditions", [])}
        gpu = outcome.status.get("gpu") or {}
        replicas = int((body.get("spec") or {}).get("replicas", 1) or 0)
        if gpu.get("product") and gpu.get("product") != "cpu":
            pods = replicas * int((outcome.status.get("plan") or {}).get("nnodes") or 1)  # groups of pods
            self.gpus[key] = (gpu["product"], pods * int(gpu.get("count") or 0))
        else:
            self.gpus.pop(key, None)
        self.metrics.publish(self.conditions, self.gpus)

    async def _reconcile(
        self,
        body: dict[str, Any],
        nodes: list[NodeGPUs],
        refit: dict[str, Any] | None = None,
        plan_image: str | None = None,
    ) -> Outcome:
        outcome = Outcome()
        old_status = body.get("status") or {}
        if refit is None:
            refit = refitting.current(old_status, body["metadata"].get("generation"), body.get("spec"))
        if refit.get("exhausted"):
            return outcome  # RefitExhausted: nothing more is written until the spec changes
        try:
            spec = parse_spec(body.get("spec"))
            check_image(spec.image, self.allowed_images)  # before anything is created or changed
            render.check_pod_fields(spec)
            decision = decide_on_nodes(spec, nodes, refit)
            check_engine_commands(
                body, spec, decision
            )  # no pod (leader, worker, pool) the engine would refuse
            if decision.multi_node and not await self.lws_available():
                raise SpecError("parallelism", lws_missing_message(decision), reason=LWS_NOT_SERVED)
            if spec.routing.policy is not None:
                check_router_args(render.router_args(body, spec))  # nor a router pod
            if spec.gateway is not None:
                check_router_args(render.router_args(body, spec, picker=True))  # nor a picker pod
        except SpecError as err:
            outcome.error = err
            status = error_status(body, err, refit)
            outcome.status = status
            before = condition(old_status, "Ready")
            await self._write_status(body, status, outcome)
            if (before.get("reason"), before.get("message")) != (err.reason, str(err)):
                await self.event(body, "Warning", err.reason, str(err), outcome)
            return outcome

        model = None
        if spec.downloads and not spec.model.cache.per_pod:
            model = await self._model(body, spec, decision, outcome)
            if model["phase"] != model_cache.READY_PHASE:  # no engine pods before the weights are there
                status = model_waiting_status(body, spec, decision, model)
                outcome.status = status
                await self._write_status(body, status, outcome)
                before = condition(old_status, "Ready")
                now = condition(status, "Ready")
                if model["phase"] == model_cache.FAILED_PHASE and (
                    before.get("reason"),
                    before.get("message"),
                ) != (now["reason"], now["message"]):
                    await self.event(body, "Warning", now["reason"], now["message"], outcome)
                return outcome

        monitor = await self.monitoring_available()
        keda = await self.keda_available()  # also when autoscaling is off: its ScaledObject must go
        # asked only of a deployment with spec.gateway, or one that had it (its pool must go)
        had_gateway = bool(old_status.get("gateway"))
        gateway = (spec.gateway is not None or had_gateway) and await self.gateway_available()
        engines: list[dict[str, Any]] = []
        fresh = not old_status  # never reconciled: its children are most likely absent, create first
        for child in render.children(
            body, spec, decision, with_service_monitor=monitor, with_keda=keda, with_gateway=gateway
        ):
            live = await self._apply(child, outcome, fresh=fresh)
            if child["kind"] in ENGINE_KINDS:
                engines.append(live)
        sts_live = combined_status(engines)
        if not fresh:
            lws = decision.multi_node or await self.lws_available()  # a group to delete only where served
            await self._delete_unwanted(
                body,
                spec,
                keda,
                outcome,
                gateway=gateway,
                had_gateway=had_gateway,
                decision=decision,
                lws=lws,
            )
        # The image the plan's memory figures hold for: kept until a pod of a new image says (profile.py).
        image = (
            plan_image or old_status.get("planImage") or render.engine_image(spec, cpu=decision.gpu is None)
        )
        status = ready_status(
            body, spec, decision, sts_live, refit, plan_image=image, model=model, gateway_served=gateway
        )
        outcome.status = status
        old_plan = old_status.get("plan")
        await self._write_status(body, status, outcome)
        degraded = condition(status, "Degraded")
        if degraded.get("reason") == GATEWAY_NOT_SERVED and condition(old_status, "Degraded").get(
            "reason"
        ) != (GATEWAY_NOT_SERVED):
            await self.event(body, "Warning", GATEWAY_NOT_SERVED, degraded["message"], outcome)
        if (
            old_plan != status["plan"]
            or (old_status.get("gpu") or {}).get("product") != status["gpu"]["product"]
        ):
            p = decision.plan
            message = (
                f"{decision.gpu_reason}; max_model_len {p.max_model_len}, kv_cache_dtype {p.kv_cache_dtype}, "
                f"tensor_parallel_size {p.tensor_parallel_size}, gpu_memory_utilization {p.gpu_memory_utilization}, "
                f"weights {decision.weights_label}"
            )
            await self.event(body, "Normal", "Planned", message, outcome)
        return outcome

    async def _model(
        self, body: dict[str, Any], spec: Any, decision: Any, outcome: Outcome
    ) -> dict[str, Any]:
        """Make sure the cache claim and the download Job exist; what the download is doing (status.model)."""
        meta = body["metadata"]
        namespace, name = meta.get("namespace"), meta["name"]
        claim = model_cache.claim_name(name, spec)
        if (
            not spec.model.cache.claim_name
            and await self.kube.get(object_path("PersistentVolumeClaim", namespace, claim)) is None
        ):
            pods = spec.max_possible_replicas * decision.nnodes  # every pod of a group mounts it
            pvc = model_cache.cache_claim(body, spec, decision, pods)
            await self.kube.create(object_path("PersistentVolumeClaim", namespace), pvc)
            outcome.writes.append(f"created PersistentVolumeClaim {namespace}/{claim}")
        job_name = model_cache.job_name(name, spec)
        job = await self.kube.get(object_path("Job", namespace, job_name))
        if job is None:
            job = await self.kube.create(
                object_path("Job", namespace), render.download_job(body, spec, decision)
            )
            outcome.writes.append(f"created Job {namespace}/{job_name}")
        pods = [
            p
            for p in await self.kube.list(object_path("Pod", namespace), f"job-name={job_name}")
            if ((p.get("metadata") or {}).get("labels") or {}).get("job-name") == job_name
        ]
        tail = ""
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        if running and not int((job.get("status") or {}).get("succeeded") or 0):
            pod = running[-1]["metadata"]["name"]
            params = {"container": model_cache.CONTAINER, "tailLines": str(model_cache.LOG_TAIL_LINES)}
            try:
                tail = await self.kube.text(object_path("Pod", namespace, pod, "log"), params)
            except (ApiError, OSError) as exc:  # progress is a nicety: the Job's state still counts
                log.debug("could not read the download log of %s: %s", pod, exc)
        return model_cache.download_state(spec, job, pods, tail, claim)

    async def _refit(self, body: dict[str, Any], nodes: list[NodeGPUs], failure: Failure) -> Outcome | None:
        """Re-plan after an engine's memory failure, roll the pods onto the new plan, or stop trying.

        Only a failure of a pod started with the current plan counts (its template's plan hash is a live
        engine template's: the StatefulSet's, a pool's, a group's leader or worker): the other replicas of a
        failed plan, and their restarts, are the same news.
        """
        meta = body["metadata"]
        namespace, name, generation = meta.get("namespace"), meta["name"], meta.get("generation")
        state = refitting.current(body.get("status"), generation, body.get("spec"))
        if state.get("exhausted") or refitting.handled(state, failure):
            return None
        if failure.plan is None or failure.plan not in await self._live_plans(namespace, name):
            return None
        try:
            spec = parse_spec(body.get("spec"))
            decision = decide(spec, pools(nodes), state)
        except SpecError:
            return None  # the spec itself cannot be served: the ordinary reconcile says so
        change = None
        if not refitting.too_many(state):
            memory = decision.gpu.memory_bytes if decision.gpu is not None else None
            change = refitting.next_settings(
                spec, decision.plan, memory, failure, state.get("settings") or {}
            )
        new_state = refitting.record(state, generation, failure, change, body.get("spec"))
        outcome = Outcome()
        what = f"pod {failure.pod}: {failure.reason} (exit code {failure.exit_code})"
        if change is None:
            why = (
                f"{refitting.MAX_ATTEMPTS} starts in a row"
                if refitting.too_many(state)
                else "no setting has room left within the spec's bounds"
            )
            message = f"{what}; " + refitting.exhausted_message(new_state, why)
            status = failed_status(body, refitting.EXHAUSTED, message, new_state)
            outcome.status = status
            await self._write_status(body, status, outcome)
            await self.event(body, "Warning", refitting.EXHAUSTED, message, outcome)
            return outcome
        await self.event(
            body,
            "Warning",
            "Refit",
            f"{what}; re-fit {new_state['attempts']} of at most {refitting.MAX_ATTEMPTS - 1}: {change[1]}",
            outcome,
        )
        result = await self._reconcile(body, nodes, new_state)
        result.writes[:0] = outcome.writes
        await self._roll(namespace, name, failure.plan, result)
        return result

    async def check_profile(
        self, namespace: str, name: str, nodes: Iterable[NodeGPUs], pod: dict[str, Any]
    ) -> Outcome | None:
        """After an engine image change: compare what a Ready pod of the new image and the current plan
        measured with the plan, and re-plan from the measurement if it is off (profile.py). None when
        there is nothing to check (the pod runs the image the plan was made for, an old plan, ...)."""
        image = _engine_image(pod)
        key = (namespace, name)
        if image is None or self.plan_images.get(key) == image or not _ready(pod):
            return None
        async with self._lock(key):
            body = await self.kube.get(object_path("InferenceDeployment", namespace, name))
            if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                return None
            status = body.get("status") or {}
            if status.get("planImage"):
                self.plan_images[key] = status["planImage"]
            if not status.get("planImage") or status["planImage"] == image:
                return None
            try:
                spec = parse_spec(body.get("spec"))
            except SpecError:
                return None
            meta = body["metadata"]
            generation = meta.get("generation")
            state = refitting.current(status, generation, body.get("spec"))
            if state.get("exhausted"):
                return None
            nodes = list(nodes)
            try:
                decision = decide(spec, pools(nodes), state)
            except SpecError:
                return None
            if render.engine_image(spec, cpu=decision.gpu is None) != image:
                return None  # a pod of an image the spec no longer asks for (in its flavour)
            pod_meta = pod.get("metadata") or {}
            plan = (pod_meta.get("annotations") or {}).get(render.PLAN_ANNOTATION)
            if plan is None or plan not in await self._live_plans(namespace, name, serving=True):
                return None
            path = f"/api/v1/namespaces/{namespace}/pods/{pod_meta.get('name')}:{render.ENGINE_PORT}/proxy"
            try:
                measured = await self.kube.get(path + profiling.MEMORY_PATH)
            except (ApiError, OSError) as exc:
                log.warning("could not read the memory profile of pod %s: %s", pod_meta.get("name"), exc)
                return None
            if not isinstance(measured, dict):
                return None
            outcome = await self._replan_from_profile(
                body, spec, decision, state, nodes, pod_meta, image, measured
            )
            self._publish(namespace, name, body, outcome)
            return outcome

    async def _live_plans(self, namespace: str, name: str, *, serving: bool = False) -> set[str]:
        """The plan hashes of the live engine templates: the StatefulSet's, each pool's, a LeaderWorkerSet's
        leader and worker templates (`serving`: only the templates of pods that serve the API)."""
        templates = []
        for sts_name in (name, render.pool_name(name, render.PREFILL), render.pool_name(name, render.DECODE)):
            sts = await self.kube.get(object_path("StatefulSet", namespace, sts_name)) or {}
            templates.append((sts.get("spec") or {}).get("template") or {})
        if await self.lws_available():
            lws = await self.kube.get(object_path("LeaderWorkerSet", namespace, name)) or {}
            group = (lws.get("spec") or {}).get("leaderWorkerTemplate") or {}
            templates.append(group.get("leaderTemplate") or {})
            if not serving:
                templates.append(group.get("workerTemplate") or {})
        plans = {
            ((t.get("metadata") or {}).get("annotations") or {}).get(render.PLAN_ANNOTATION)
            for t in templates
        }
        return {p for p in plans if p}

    async def _replan_from_profile(
        self,
        body: dict[str, Any],
        spec: Any,
        decision: Any,
        state: dict[str, Any],
        nodes: list[NodeGPUs],
        pod_meta: dict[str, Any],
        image: str,
        measured: dict[str, Any],
    ) -> Outcome:
        meta = body["metadata"]
        namespace, name, generation = meta.get("namespace"), meta["name"], meta.get("generation")
        outcome = Outcome()
        found = profiling.differences(decision.plan, measured)
        if not found:
            outcome.writes.append("status")
            await self.kube.merge_patch(
                object_path("InferenceDeployment", namespace, name, "status"),
                {"status": {"planImage": image}},
            )
            self.plan_images[(namespace, name)] = image
            await self.event(
                body,
                "Normal",
                "MemoryProfileChecked",
                f"pod {pod_meta.get('name')} of image {image} measured the memory the plan assumed "
                f"(within {profiling.TOLERANCE:.0%})",
                outcome,
            )
            return outcome
        failure = Failure(
            key=f"{pod_meta.get('uid') or pod_meta.get('name')}/profile/{image}",
            pod=str(pod_meta.get("name")),
            reason=profiling.REASON,
            exit_code=None,
            plan=(pod_meta.get("annotations") or {}).get(render.PLAN_ANNOTATION),
            message="; ".join(found)[:500],
            profile=measured,
        )
        what = f"pod {pod_meta.get('name')} of image {image}: " + "; ".join(found)
        if refitting.too_many(state):
            new_state = refitting.record(state, generation, failure, None, body.get("spec"))
            message = f"{what}; " + refitting.exhausted_message(
                new_state, f"{refitting.MAX_ATTEMPTS} re-plans in a row"
            )
            status = failed_status(body, refitting.EXHAUSTED, message, new_state)
            status["planImage"] = image
            outcome.status = status
            await self._write_status(body, status, outcome)
            await self.event(body, "Warning", refitting.EXHAUSTED, message, outcome)
            return outcome
        change = profiling.next_settings(spec, decision.plan, measured, state.get("settings") or {})
        new_state = refitting.record(state, generation, failure, change, body.get("spec"))
        await self.event(
            body,
            "Warning",
            "Replanned",
            f"{what}; re-planned from the measured profile ({change[1]}), attempt {new_state['attempts']} of "
            f"at most {refitting.MAX_ATTEMPTS - 1}",
            outcome,
        )
        result = await self._reconcile(body, nodes, new_state, plan_image=image)
        result.writes[:0] = outcome.writes
        self.plan_images[(namespace, name)] = image
        return result

    async def _delete_unwanted(
        self,
        body: dict[str, Any],
        spec: Any,
        keda: bool,
        outcome: Outcome,
        *,
        gateway: bool = False,
        had_gateway: bool = False,
        decision: Any = None,
        lws: bool = False,
    ) -> None:
        """Delete the optional children this spec no longer has (only ones this operator made), and the
        engines of another shape (a StatefulSet after a switch to a LeaderWorkerSet or two pools, ...)."""
        meta = body["metadata"]
        unwanted = render.unwanted(
            body, spec, with_keda=keda, with_gateway=gateway, had_gateway=had_gateway, decision=decision,
            with_lws=lws,
        )  # fmt: skip
        for kind, child in unwanted:
            path = object_path(kind, meta.get("namespace"), child)
            live = await self.kube.get(path)
            labels = ((live or {}).get("metadata") or {}).get("labels") or {}
            if live is None or labels.get(render.LABEL_OWNER) != meta["name"]:
                continue
            await self.kube.delete(path)
            outcome.writes.append(f"deleted {kind} {meta.get('namespace')}/{child}")

    async def _roll(self, namespace: str, name: str, old_plan: str, outcome: Outcome) -> None:
        """Delete the pods of `old_plan` that are not Ready: a crash-looping pod blocks a StatefulSet's rolling
        update, and the StatefulSet recreates each from the new template. Ready pods roll as usual."""
        pods = await self.kube.list(object_path("Pod", namespace), f"{render.LABEL_OWNER}={name}")
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(render.LABEL_OWNER) != name:
                continue
            if (meta.get("annotations") or {}).get(render.PLAN_ANNOTATION) != old_plan:
                continue
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or []
            )
            if not ready:
                await self.kube.delete(object_path("Pod", namespace, meta["name"]))
                outcome.writes.append(f"deleted Pod {namespace}/{meta['name']} (old plan, not ready)")

    async def _apply(
        self, desired: dict[str, Any], outcome: Outcome, *, fresh: bool = False
    ) -> dict[str, Any]:
        live = await self._apply_one(desired, outcome, fresh)
        if desired["kind"] in ENGINE_KINDS:
            meta = desired["metadata"]
            rv = (live.get("metadata") or {}).get("resourceVersion")
            if rv is not None:
                self._written[(meta["namespace"], meta["name"])] = rv
        return live

    async def _apply_one(self, desired: dict[str, Any], outcome: Outcome, fresh: bool) -> dict[str, Any]:
        kind, meta = desired["kind"], desired["metadata"]
        path = object_path(kind, meta["namespace"], meta["name"])
        what = f"{kind} {meta['namespace']}/{meta['name']}"
        if fresh:
            try:
                created = await self.kube.create(object_path(kind, meta["namespace"]), desired)
                outcome.writes.append(f"created {what}")
                return created
            except ApiError as exc:
                if exc.status != 409:  # 409: it exists after all, compare it below
                    raise
        live = await self.kube.get(path)
        if live is None:
            outcome.writes.append(f"created {what}")
            return await self.kube.create(object_path(kind, meta["namespace"]), desired)
        if in_sync(desired, live):
            return live
        live_hash = (live.get("metadata", {}).get("annotations") or {}).get(render.HASH_ANNOTATION)
        want_hash = meta["annotations"][render.HASH_ANNOTATION]
        if kind == "StatefulSet" and any(
            not is_subset(desired["spec"].get(f), live.get("spec", {}).get(f)) for f in IMMUTABLE_STS
        ):
            # Immutable fields changed (e.g. NVMe offload turned on): recreate, leaving the pods to be adopted.
            outcome.writes.append(f"recreated {what} (immutable fields changed)")
            await self.kube.delete(path, orphan=True)
            return await self.kube.create(object_path(kind, meta["namespace"]), desired)
        outcome.writes.append(f"replaced {what}" + (" (drift)" if live_hash == want_hash else ""))
        return await self.kube.replace(path, replacement(desired, live))

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any], outcome: Outcome) -> None:
        patch = merge_patch(body.get("status") or {}, status)
        if not patch:
            return
        meta = body["metadata"]
        outcome.writes.append("status")
        await self.kube.merge_patch(
            object_path("InferenceDeployment", meta.get("namespace"), meta["name"], "status"),
            {"status": patch},
        )

    async def event(
        self, body: dict[str, Any], kind: str, reason: str, message: str, outcome: Outcome
    ) -> None:
        """A Kubernetes Event on the InferenceDeployment (best effort: a lost Event never fails a reconcile)."""
        meta = body["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": render.API_VERSION,
                "kind": render.KIND,
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "type": kind,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": render.MANAGED_BY},
            "reportingComponent": f"pagoda.dev/{render.MANAGED_BY}",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        outcome.writes.append(f"event {reason}")
        try:
            await self.kube.create(object_path("Event", meta.get("namespace")), event)
        except (ApiError, OSError) as exc:
            log.warning("could not post Event %s for %s: %s", reason, meta["name"], exc)
