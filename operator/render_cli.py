"""`pagoda render FILE.yaml [--nodes nodes.yaml | --gpu H100]`: the objects an InferenceDeployment becomes.

No cluster needed: for GitOps and review. Every object the operator would create, built by the operator's own
functions (the model cache claim and download Job first, as the operator creates them before any engine pod);
what the operator discovers in a cluster (KEDA, the Prometheus Operator, ...) is told with flags. The YAML
output applies as is (the plan rides along as comments); `--output json` gives children, plan and GPU choice
for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml
from pagoda.engine.sizing import GPUInfo, SizingError, lookup_gpu
from pagoda.operator import render
from pagoda.operator.contract import check_engine_commands, check_router_args
from pagoda.operator.discovery import LWS_API, RENDERED_NODE, Capabilities, GPUPool, node_gpus, pools
from pagoda.operator.planning import Decision, decide
from pagoda.operator.spec import SpecError, parse_spec


def _load_documents(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") if path != "-" else sys.stdin as handle:
        docs = [d for d in yaml.safe_load_all(handle) if d]
    out: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: every document must be a mapping")
        out.extend(doc.get("items", []) if doc.get("kind", "").endswith("List") else [doc])
    return out


def _pools_for(args: argparse.Namespace, count: int, product: str) -> dict[str, GPUPool]:
    if args.nodes:
        found = [g for g in (node_gpus(n) for n in _load_documents(args.nodes)) if g is not None]
        return pools(found)
    name = args.gpu or product
    if not name:
        return {}
    gpu = lookup_gpu(name)
    per_node = max(count, args.gpus_per_node)
    info = GPUInfo.from_spec(gpu, per_node)
    label = gpu.labels[0]
    return {label: GPUPool(label, info, [RENDERED_NODE], per_node)}


def render_document(
    body: dict[str, Any], available: dict[str, GPUPool], capabilities: Capabilities | None = None
) -> tuple[Decision, list[dict]]:
    """Decision and every object the operator would create for one InferenceDeployment body, in the order
    it creates them, in a cluster with ``capabilities``; raises SpecError when unservable."""
    caps = capabilities or Capabilities()
    spec = parse_spec(body.get("spec"))
    render.check_pod_fields(spec)
    decision = decide(spec, available)
    body = {**body, "metadata": {"namespace": "default", **body.get("metadata", {})}}
    check_engine_commands(body, spec, decision)  # what the operator refuses (any pod's command), refused here
    if spec.routing.policy is not None:
        check_router_args(render.router_args(body, spec))
    if spec.gateway is not None:
        check_router_args(render.router_args(body, spec, picker=True))
    children = render.children(
        body,
        spec,
        decision,
        with_service_monitor=caps.prometheus_operator,
        with_keda=caps.keda,
        with_gateway=caps.gateway_api,
    )
    return decision, render.model_objects(body, spec, decision) + children


def _comment(decision: Decision, name: str) -> str:
    plan = decision.plan
    lines = [f"InferenceDeployment {name}: {decision.gpu_reason}"]
    for key in ("gpu_memory_utilization", "max_model_len", "block_size", "kv_cache_dtype", "max_num_seqs",
                "max_num_batched_tokens", "tensor_parallel_size", "num_gpu_blocks", "kv_offload_host_bytes",
                "kv_offload_disk_bytes", "pvc_size"):  # fmt: skip
        value = getattr(plan, key)
        if value in (None, ""):
            continue
        why = plan.reasons.get(key, "")
        lines.append(f"  {key}: {value}" + (f"  -- {why}" if why else ""))
    lines.append(f"  max_num_queued_reqs: {decision.max_num_queued_reqs}  -- {decision.queue_reason}")
    if decision.pipeline_parallel_size > 1 or decision.multi_node:
        lines.append(f"  pipeline_parallel_size: {decision.pipeline_parallel_size}, nnodes: {decision.nnodes}  -- "
                     f"{decision.parallel_reason}")  # fmt: skip
    if decision.multi_node:
        lines.append(
            f"  note: each replica is a LeaderWorkerSet group of {decision.nnodes} pods: this needs the "
            f"LeaderWorkerSet API ({LWS_API}) in the cluster (https://github.com/kubernetes-sigs/lws); the "
            "operator says so in a condition where it is not served"
        )
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(f"# {line}" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda render", description=__doc__.splitlines()[0])
    parser.add_argument(
        "file", help="an InferenceDeployment YAML file (several documents allowed; - for stdin)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--nodes", help="a YAML file of Node objects (kubectl get nodes -o yaml) to plan against"
    )
    where.add_argument("--gpu", help="plan for this GPU (short name like H100 or a GFD product label)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node with --gpu (default 8)")
    cluster = parser.add_argument_group(
        "cluster capabilities", "what the operator discovers in a cluster and a render cannot: say it here"
    )
    cluster.add_argument(
        "--prometheus-operator",
        "--service-monitor",
        dest="prometheus_operator",
        action="store_true",
        help="the Prometheus Operator is installed: render the ServiceMonitor (unless spec.serviceMonitor is off)",
    )
    cluster.add_argument(
        "--keda",
        action="store_true",
        help="KEDA is installed: render a ScaledObject instead of the HorizontalPodAutoscaler (spec.autoscaling)",
    )
    cluster.add_argument(
        "--lws",
        action="store_true",
        help="LeaderWorkerSet is installed. A replica spanning nodes renders a LeaderWorkerSet with or without "
        "it (a render cannot look; its comment says the API is needed)",
    )
    cluster.add_argument(
        "--gateway-api",
        action="store_true",
        help="the Gateway API Inference Extension is installed (inference.networking.k8s.io/v1): render "
        "spec.gateway's InferencePool and its endpoint picker (Deployment and Service)",
    )
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    args = parser.parse_args(argv)
    capabilities = Capabilities(
        prometheus_operator=args.prometheus_operator,
        keda=args.keda,
        lws=args.lws,
        gateway_api=args.gateway_api,
    )

    try:
        bodies = [d for d in _load_documents(args.file) if d.get("kind") == render.KIND]
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"pagoda render: {exc}", file=sys.stderr)
        return 2
    if not bodies:
        print(f"pagoda render: {args.file} has no {render.KIND}", file=sys.stderr)
        return 2

    failed = False
    results: list[dict[str, Any]] = []
    out: list[str] = []
    for body in bodies:
        name = (body.get("metadata") or {}).get("name", "?")
        if args.gpu:  # "plan for this GPU" wins over the file's gpu.product
            body = {**body, "spec": {**(body.get("spec") or {})}}
            body["spec"]["gpu"] = {**(body["spec"].get("gpu") or {}), "product": args.gpu}
        try:
            spec = parse_spec(body.get("spec"))
            available = _pools_for(args, spec.gpu.count, spec.gpu.product)
            decision, objects = render_document(body, available, capabilities)
        except (SpecError, SizingError, ValueError, OSError) as exc:
            print(f"pagoda render: {name}: {exc}", file=sys.stderr)
            failed = True
            continue
        results.append({"name": name, "gpu": decision.status_gpu(decision.pod_gpus), "plan": decision.status_plan(),
                        "children": objects})  # fmt: skip
        out.append(_comment(decision, name))
        out.extend("---\n" + yaml.safe_dump(obj, sort_keys=False).rstrip() for obj in objects)
    if args.output == "json":
        print(json.dumps(results, indent=2))
    elif out:
        print("\n".join(out))
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
