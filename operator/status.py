"""The InferenceDeployment status: conditions, plan, GPU and readiness, and the minimal patch to get there."""

from __future__ import annotations

import datetime
import json
from typing import Any

from pagoda.operator import render
from pagoda.operator.planning import Decision
from pagoda.operator.spec import InferenceSpec, SpecError

CONDITIONS = ("Ready", "Progressing", "Degraded")
GATEWAY_NOT_SERVED = "GatewayAPINotServed"  # spec.gateway where the cluster lacks the InferencePool API


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conditions(
    old: list[dict[str, Any]] | None, new: dict[str, tuple[str, str, str]], generation: int | None
) -> list[dict[str, Any]]:
    """Conditions in a fixed order; lastTransitionTime moves only when a condition's status does."""
    previous = {c.get("type"): c for c in old or [] if isinstance(c, dict)}
    out = []
    for kind in CONDITIONS:
        status, reason, message = new[kind]
        before = previous.get(kind, {})
        changed = before.get("status") != status
        cond = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now()
            if changed or not before.get("lastTransitionTime")
            else before["lastTransitionTime"],
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def _normal(value: Any) -> Any:
    """JSON-shaped, without null fields: a merge patch cannot store a null, so none may be compared."""

    def drop_nulls(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: drop_nulls(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [drop_nulls(x) for x in v]
        return v

    return drop_nulls(json.loads(json.dumps(value)))


def ready_status(
    body: dict[str, Any],
    spec: InferenceSpec,
    decision: Decision,
    sts: dict[str, Any] | None,
    refit: dict[str, Any] | None = None,
    plan_image: str | None = None,
    model: dict[str, Any] | None = None,
    gateway_served: bool = False,
) -> dict[str, Any]:
    """Status after a successful apply: the plan, the GPU choice, what the StatefulSet reports, the
    re-fit (status.refit) the plan carries, if any, the image the plan's memory figures are for, the
    model download (status.model) when there is one, and spec.gateway's pool and picker (`gateway_served`:
    the cluster serves the InferencePool API; without it Degraded says so and nothing of it is rendered)."""
    meta = body["metadata"]
    old = body.get("status") or {}
    generation = meta.get("generation")
    sts_status = (sts or {}).get("status") or {}
    ready = int(sts_status.get("readyReplicas") or 0)
    current = int(sts_status.get("replicas") or 0)
    updated = int(sts_status.get("updatedReplicas") or 0)
    sts_generation = (sts or {}).get("metadata", {}).get("generation")
    rolled_out = sts_generation is None or sts_status.get("observedGeneration") == sts_generation
    want = spec.engine_replicas
    if want == 0:
        readiness = ("True", "ScaledToZero", "replicas is 0")
    elif ready >= want:
        readiness = ("True", "AllReplicasReady", f"{ready}/{want} engine pods ready")
    else:
        readiness = ("False", "PodsNotReady", f"{ready}/{want} engine pods ready")
    if ready >= want and updated >= want and rolled_out:
        progressing = ("False", "RolloutComplete", "every pod runs the current plan")
    else:
        progressing = (
            "True",
            "RollingOut",
            f"{updated}/{want} pods updated to the current plan, {ready} ready",
        )
    warnings = decision.plan.warnings
    degraded = (
        "False",
        "AsPlanned",
        "the spec is served as planned" + (f" ({len(warnings)} warnings in status.plan)" if warnings else ""),
    )
    if refit and refit.get("settings"):
        changes = "; ".join(h["change"] for h in refit.get("history") or [] if h.get("change"))
        degraded = (
            "True",
            "Refitted",
            f"re-planned {refit.get('attempts')} time(s) from what the engines reported (out of memory, or a "
            f"new image's measured memory): {changes} (status.refit)",
        )
    name, namespace = meta["name"], meta.get("namespace", "default")
    gateway = None
    if spec.gateway is not None:
        gateway = {"apiServed": gateway_served, "inferencePool": name if gateway_served else None,
                   "picker": render.picker_name(name) if gateway_served else None}  # fmt: skip
        if not gateway_served and degraded[0] == "False":
            degraded = (
                "True",
                GATEWAY_NOT_SERVED,
                f"spec.gateway asks for an InferencePool, but the cluster does not serve "
                f"{render.INFERENCE_POOL_API} (install the Gateway API Inference Extension's CRDs): no pool "
                "or endpoint picker is rendered; the engines are served as without spec.gateway",
            )
    status = {
        "observedGeneration": generation,
        "phase": readiness[1],
        "conditions": _conditions(
            old.get("conditions"),
            {"Ready": readiness, "Progressing": progressing, "Degraded": degraded},
            generation,
        ),
        "plan": decision.status_plan(),
        "gpu": decision.status_gpu(decision.pod_gpus),
        "replicas": current,
        "readyReplicas": ready,
        "endpoint": f"http://{name}.{namespace}.svc.cluster.local:{render.ENGINE_PORT}/v1",
        "selector": render.selector_string(name, render.LEADER if decision.multi_node else None),
        "refit": refit or None,
        "planImage": plan_image,
        "routing": {
            "policy": spec.routing.policy or "none",
            "router": render.router_name(name) if spec.routing.policy else None,
        },
        "autoscaling": _autoscaling_status(spec),
        "model": model,
        "gateway": gateway,
    }
    if generation is None:
        del status["observedGeneration"]
    return _normal(status)


def _autoscaling_status(spec: InferenceSpec) -> dict[str, Any] | None:
    auto = spec.autoscaling
    if auto is None:
        return None
    return {
        "minReplicas": auto.min_replicas,
        "maxReplicas": auto.max_replicas,
        "metric": auto.metric,
        "target": auto.target,
    }


def error_status(
    body: dict[str, Any], error: SpecError, refit: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Status for a spec that cannot be served: the last good plan stays, the conditions say why not."""
    return failed_status(body, error.reason, str(error), refit)


def failed_status(
    body: dict[str, Any], reason: str, message: str, refit: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ready=False for `reason`: the last good plan stays; status.refit is this generation's, or none."""
    old = dict(body.get("status") or {})
    old.pop("refit", None)
    if refit:
        old["refit"] = refit
    generation = body["metadata"].get("generation")
    conds = {
        "Ready": ("False", reason, message),
        "Progressing": ("False", reason, "waiting for the spec (or the cluster) to change"),
        "Degraded": ("True", reason, message),
    }
    old["conditions"] = _conditions(old.get("conditions"), conds, generation)
    old["phase"] = reason
    if generation is not None:
        old["observedGeneration"] = generation
    old.setdefault("selector", render.selector_string(body["metadata"]["name"]))
    old.setdefault("replicas", 0)
    old.setdefault("readyReplicas", 0)
    return _normal(old)


def model_waiting_status(
    body: dict[str, Any], spec: InferenceSpec, decision: Decision, model: dict[str, Any]
) -> dict[str, Any]:
    """While the weights download (or after the download failed): no engine pods yet; the plan is shown so
    users see what will run, the conditions say what the download is doing, or why it failed."""
    from pagoda.operator import model_cache

    meta = body["metadata"]
    old = body.get("status") or {}
    generation = meta.get("generation")
    if model["phase"] == model_cache.FAILED_PHASE:
        reason, message = model["reason"], f"the model download failed: {model['message']}"
        conds = {
            "Ready": ("False", reason, message),
            "Progressing": ("False", reason, "waiting for the spec (or its Secret) to change"),
            "Degraded": ("True", reason, message),
        }
    else:
        reason, message = "Downloading", model_cache.progress_words(model)
        if model.get("lastError"):
            message += f"; retrying after {model['lastError']}"
        conds = {
            "Ready": ("False", reason, message),
            "Progressing": ("True", reason, message),
            "Degraded": ("False", "AsPlanned", "the engine pods start when the download is complete"),
        }
    status = {
        "observedGeneration": generation,
        "phase": reason,
        "conditions": _conditions(old.get("conditions"), conds, generation),
        "plan": decision.status_plan(),
        "gpu": decision.status_gpu(decision.pod_gpus),
        "model": model,
        "replicas": int(old.get("replicas") or 0),
        "readyReplicas": int(old.get("readyReplicas") or 0),
        "selector": render.selector_string(meta["name"]),
    }
    if generation is None:
        del status["observedGeneration"]
    return _normal(status)


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`; {} when they are equal."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = (
                merge_patch(old[key], value)
                if isinstance(value, dict) and isinstance(old[key], dict)
                else value
            )
    return patch


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}
