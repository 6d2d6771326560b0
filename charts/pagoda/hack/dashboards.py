"""Writes the Grafana dashboards charts/pagoda/dashboards/{engine,operator}.json.

Dashboards are generated rather than hand-edited so every panel gets the same datasource variable,
the same label selector and a consistent layout. tests/dashboards checks the committed JSON matches
this script's output. Run: python charts/pagoda/hack/dashboards.py
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
# engine series: namespace and pod from the scrape, app_kubernetes_io_instance = InferenceDeployment name
# (the ServiceMonitor copies the pod label app.kubernetes.io/instance with podTargetLabels)
ENGINE_SEL = 'namespace=~"$namespace", app_kubernetes_io_instance=~"$inferencedeployment", pod=~"$pod"'
OPERATOR_SEL = 'namespace=~"$namespace", pod=~"$pod"'
# router series (the InferenceDeployment's router pods, scraped through its client Service): the engine pod
# variable does not apply, the router's own pod label tells them apart
ROUTER_SEL = 'namespace=~"$namespace", app_kubernetes_io_instance=~"$inferencedeployment", app_kubernetes_io_name="pagoda-router"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


def _datasource_var() -> dict:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def _query_var(name: str, label: str, query: str, *, multi: bool) -> dict:
    var = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2,
        "sort": 1,
        "current": {},
        "hide": 0,
        "options": [],
        "multi": multi,
        "includeAll": multi,
    }
    if multi:
        var["allValue"] = ".*"
    return var


class Layout:
    """Places panels left to right in a 24-column grid and hands out panel ids."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "id": self._id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        kind: str = "timeseries",
        w: int = 8,
        h: int = 8,
        description: str = "",
        minimum: float | None = 0,
        maximum: float | None = None,
    ) -> None:
        if self.x + w > 24:
            self._newline()
        defaults: dict = {"unit": unit}
        if minimum is not None:
            defaults["min"] = minimum
        if maximum is not None:
            defaults["max"] = maximum
        panel = {
            "id": self._id(),
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": _options(kind),
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": kind != "table",
                    "instant": kind == "table",
                }
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _options(kind: str) -> dict:
    if kind == "timeseries":
        return {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
        }
    return {"showHeader": True}


def _quantiles(metric: str, sel: str, by: str = "") -> list[tuple[str, str]]:
    extra = f", {by}" if by else ""
    legend_by = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by (le{extra}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
            f"p{int(q * 100)}{legend_by}",
        )
        for q in QUANTILES
    ]


def _dashboard(uid: str, title: str, description: str, variables: list[dict], panels: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pagoda", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": variables},
        "panels": panels,
    }


def engine_dashboard() -> dict:
    s = ENGINE_SEL
    lay = Layout()
    lay.row("KV cache")
    lay.panel(
        "KV cache usage",
        [(f"max by (pod) (vllm:kv_cache_usage_perc{{{s}}})", "{{pod}}")],
        unit="percentunit",
        maximum=1,
        description="Share of usable KV blocks in use. Sustained > 90% means preemptions and queueing.",
    )
    lay.panel(
        "KV blocks: total, free, cached",
        [
            (f"sum by (pod) (pagoda:kv_blocks_total{{{s}}})", "total {{pod}}"),
            (f"sum by (pod) (pagoda:kv_blocks_free{{{s}}})", "free {{pod}}"),
            (f"sum by (pod) (pagoda:kv_blocks_cached{{{s}}})", "cached {{pod}}"),
        ],
        description="Free blocks hold nothing; cached blocks are unreferenced but keep a reusable prefix.",
    )
    lay.panel(
        "Prefix-cache hit rate",
        [
            (
                f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{s}}}[{RATE}]))"
                f" / sum by (pod) (rate(vllm:prefix_cache_queries_total{{{s}}}[{RATE}]))",
                "tokens {{pod}}",
            ),
            (f"max by (pod) (pagoda:prefix_cache_hit_ratio{{{s}}})", "last 100 requests {{pod}}"),
        ],
        unit="percentunit",
        maximum=1,
        description="Share of prompt tokens served from the prefix cache instead of being recomputed.",
    )
    lay.panel(
        "Cached prompt tokens by source",
        [
            (
                f"sum by (source) (rate(vllm:prompt_tokens_cached_by_source_total{{{s}}}[{RATE}]))",
                "{{source}}",
            )
        ],
        unit="short",
        w=12,
        description="Prompt tokens per second whose KV came from the device, host RAM or disk tier.",
    )
    lay.panel(
        "max-model-len: configured vs fitted",
        [
            (f"max by (pod) (pagoda:max_model_len{{{s}}})", "configured {{pod}}"),
            (f"max by (pod) (pagoda:max_model_len_fitted{{{s}}})", "fitted {{pod}}"),
        ],
        kind="stat",
        w=12,
        description="The context length served, and the longest sequence the KV memory could hold.",
    )

    lay.row("Requests")
    lay.panel(
        "Requests running / waiting",
        [
            (f"sum by (pod) (vllm:num_requests_running{{{s}}})", "running {{pod}}"),
            (f"sum by (pod) (vllm:num_requests_waiting{{{s}}})", "waiting {{pod}}"),
        ],
    )
    lay.panel(
        "Preemptions",
        [(f"sum by (pod) (rate(vllm:num_preemptions_total{{{s}}}[{RATE}]))", "{{pod}}")],
        unit="reqps",
        description="Requests preempted per second because the KV cache ran out of blocks.",
    )
    lay.panel(
        "Finished requests by reason",
        [
            (
                f"sum by (finished_reason) (rate(vllm:request_success_total{{{s}}}[{RATE}]))",
                "{{finished_reason}}",
            )
        ],
        unit="reqps",
    )

    lay.row("Latency")
    lay.panel(
        "Time to first token",
        _quantiles("vllm:time_to_first_token_seconds", s),
        unit="s",
    )
    lay.panel(
        "Inter-token latency",
        _quantiles("vllm:inter_token_latency_seconds", s),
        unit="s",
    )
    lay.panel(
        "End-to-end request latency",
        _quantiles("vllm:e2e_request_latency_seconds", s),
        unit="s",
    )
    lay.panel(
        "Queue time",
        _quantiles("vllm:request_queue_time_seconds", s),
        unit="s",
        w=12,
    )
    lay.panel(
        "Prompt and generation tokens/s",
        [
            (f"sum(rate(vllm:prompt_tokens_total{{{s}}}[{RATE}]))", "prompt"),
            (f"sum(rate(vllm:generation_tokens_total{{{s}}}[{RATE}]))", "generation"),
        ],
        unit="short",
        w=12,
    )

    lay.row("Offload tiers")
    lay.panel(
        "Tier usage",
        [
            (
                f"sum by (pod, tier) (pagoda:offload_bytes_used{{{s}}})"
                f" / sum by (pod, tier) (pagoda:offload_bytes_capacity{{{s}}})",
                "{{tier}} {{pod}}",
            )
        ],
        unit="percentunit",
        maximum=1,
        description="Bytes held by each offload tier over its budget.",
    )
    lay.panel(
        "Tier bytes and blocks",
        [
            (f"sum by (tier) (pagoda:offload_bytes_used{{{s}}})", "bytes {{tier}}"),
            (f"sum by (tier) (pagoda:offload_blocks{{{s}}})", "blocks {{tier}}"),
        ],
        unit="bytes",
    )
    lay.panel(
        "Tier hit rate",
        [
            (
                f"sum by (tier) (rate(pagoda:offload_hits_total{{{s}}}[{RATE}]))"
                f" / sum by (tier) (rate(pagoda:offload_queries_total{{{s}}}[{RATE}]))",
                "{{tier}}",
            )
        ],
        unit="percentunit",
        maximum=1,
        description="Share of prompt tokens looked up in a tier that were found there.",
    )
    lay.panel(
        "Tier load latency",
        _quantiles("pagoda:offload_load_seconds", s, by="tier"),
        unit="s",
    )
    lay.panel(
        "Tier store latency",
        _quantiles("pagoda:offload_store_seconds", s, by="tier"),
        unit="s",
    )
    lay.panel(
        "Tier load / store throughput",
        [
            (f"sum by (tier) (rate(pagoda:offload_load_bytes_total{{{s}}}[{RATE}]))", "load {{tier}}"),
            (f"sum by (tier) (rate(pagoda:offload_store_bytes_total{{{s}}}[{RATE}]))", "store {{tier}}"),
        ],
        unit="Bps",
    )
    lay.panel(
        "Verification failures and evictions",
        [
            (
                f"sum by (tier) (rate(pagoda:offload_verification_failures_total{{{s}}}[{RATE}]))",
                "verification failures {{tier}}",
            ),
            (f"sum by (tier) (rate(pagoda:offload_evictions_total{{{s}}}[{RATE}]))", "evictions {{tier}}"),
        ],
        unit="ops",
        w=12,
        description="Blocks read back that failed their checksum/fingerprint check (treated as misses).",
    )
    lay.panel(
        "Admission rejections",
        [(f"sum by (reason) (rate(pagoda:admission_rejections_total{{{s}}}[{RATE}]))", "{{reason}}")],
        unit="reqps",
        w=12,
        description="Requests refused before queueing (HTTP 503), by reason.",
    )

    lay.row("Speculative decoding")
    accepted = f"sum by (pod) (rate(vllm:spec_decode_num_accepted_tokens_total{{{s}}}[{RATE}]))"
    lay.panel(
        "Speculative decoding acceptance rate",
        [
            (
                f"{accepted} / sum by (pod) (rate(vllm:spec_decode_num_draft_tokens_total{{{s}}}[{RATE}]))",
                "accepted / proposed {{pod}}",
            )
        ],
        unit="percentunit",
        maximum=1,
        w=8,
        description="Share of proposed tokens the target model accepted (--speculative-config). Low rates "
        "mean the proposals mostly miss: each costs a scored position for nothing.",
    )
    lay.panel(
        "Speculative decoding: tokens per verified step",
        [
            (
                f"1 + {accepted} / sum by (pod) (rate(vllm:spec_decode_num_drafts_total{{{s}}}[{RATE}]))",
                "mean tokens per step {{pod}}",
            )
        ],
        w=8,
        description="Tokens a sequence gets from one forward when it verifies a proposal (1 without one).",
    )
    lay.panel(
        "Speculative decoding acceptance by position",
        [
            (
                f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{s}}}[{RATE}]))"
                f" / scalar(sum(rate(vllm:spec_decode_num_drafts_total{{{s}}}[{RATE}])))",
                "position {{position}}",
            )
        ],
        unit="percentunit",
        maximum=1,
        w=8,
        description="Share of proposals whose token at each position was accepted (it falls with the position).",
    )

    _router_row(lay)

    first = "vllm:num_requests_running"
    variables = [
        _datasource_var(),
        _query_var("namespace", "Namespace", f"label_values({first}, namespace)", multi=False),
        _query_var(
            "inferencedeployment",
            "InferenceDeployment",
            f'label_values({first}{{namespace=~"$namespace"}}, app_kubernetes_io_instance)',
            multi=True,
        ),
        _query_var(
            "pod",
            "Pod",
            f'label_values({first}{{namespace=~"$namespace", app_kubernetes_io_instance=~"$inferencedeployment"}}, pod)',
            multi=True,
        ),
    ]
    return _dashboard(
        "pagoda-engine",
        "Pagoda / Engine",
        "Pagoda engine pods: KV cache, requests, latency, throughput, offload tiers and sizing.",
        variables,
        lay.panels,
    )


def _router_row(lay: Layout) -> None:
    """The router in front of the engines (spec.routing): its decisions, what it predicted the engines had
    cached against what they reported, its own latency, and how it sees each engine."""
    r = ROUTER_SEL
    lay.row("Router")
    lay.panel(
        "Routing decisions by policy and reason",
        [
            (
                f"sum by (policy, reason) (rate(pagoda:router_decisions_total{{{r}}}[{RATE}]))",
                "{{policy}} {{reason}}",
            )
        ],
        unit="reqps",
        description="Why each request went where it did (a cached prefix, the least load, a fallback, ...).",
    )
    lay.panel(
        "Cached prompt tokens: predicted vs observed",
        [
            (
                f"sum(rate(pagoda:router_predicted_cached_tokens_total{{{r}}}[{RATE}]))"
                f" / sum(rate(pagoda:router_prompt_tokens_total{{{r}}}[{RATE}]))",
                "predicted",
            ),
            (
                f"sum(rate(pagoda:router_observed_cached_tokens_total{{{r}}}[{RATE}]))"
                f" / sum(rate(pagoda:router_prompt_tokens_total{{{r}}}[{RATE}]))",
                "observed",
            ),
        ],
        unit="percentunit",
        maximum=1,
        description="Share of prompt tokens the router expected the chosen engine to have cached, and the share "
        "the engines reported cached. Observed far below predicted: the router's view of the caches is stale.",
    )
    lay.panel(
        "Routing overhead",
        _quantiles("pagoda:router_routing_overhead_seconds", r),
        unit="s",
        description="From the request body to the chosen engine: tokenize, hash the blocks, score the engines.",
    )
    lay.panel(
        "Engines: healthy and draining",
        [
            (f"sum by (backend) (pagoda:router_backend_healthy{{{r}}})", "healthy {{backend}}"),
            (f"sum by (backend) (pagoda:router_backend_draining{{{r}}})", "draining {{backend}}"),
        ],
        maximum=1,
        description="An engine that fails its health check, or drains before it stops, gets no new requests.",
    )
    lay.panel(
        "Engine load seen by the router",
        [(f"sum by (backend) (pagoda:router_backend_load{{{r}}})", "{{backend}}")],
        description="Running + waiting + in flight, per engine.",
    )
    lay.panel(
        "Router requests by status",
        [(f"sum by (code) (rate(pagoda:router_requests_total{{{r}}}[{RATE}]))", "{{code}}")],
        unit="reqps",
    )
    lay.panel(
        "KV blocks the router knows, by engine and tier",
        [(f"sum by (backend, tier) (pagoda:router_backend_kv_blocks{{{r}}})", "{{tier}} {{backend}}")],
        w=24,
        description="From the engines' KV events: blocks on the device, in host RAM, on disk.",
    )


def operator_dashboard() -> dict:
    s = OPERATOR_SEL
    lay = Layout()
    lay.row("InferenceDeployments")
    lay.panel(
        "InferenceDeployments by condition",
        [
            (
                f"max by (condition, status) (pagoda_operator_inference_deployments{{{s}}})",
                "{{condition}}={{status}}",
            )
        ],
        w=12,
        description="How many InferenceDeployments have each condition in each status.",
    )
    lay.panel(
        "GPUs requested by product",
        [(f"max by (product) (pagoda_operator_gpus_requested{{{s}}})", "{{product}}")],
        w=12,
        description="GPUs the reconciled InferenceDeployments ask for, per GPU product.",
    )
    lay.row("Reconciliation")
    lay.panel(
        "Reconciles by result",
        [(f"sum by (result) (rate(pagoda_operator_reconciles_total{{{s}}}[{RATE}]))", "{{result}}")],
        unit="ops",
    )
    lay.panel(
        "Reconcile errors by reason",
        [(f"sum by (reason) (rate(pagoda_operator_reconcile_errors_total{{{s}}}[{RATE}]))", "{{reason}}")],
        unit="ops",
    )
    lay.panel(
        "Reconcile latency",
        _quantiles("pagoda_operator_reconcile_duration_seconds", s),
        unit="s",
    )
    first = "pagoda_operator_reconciles_total"
    variables = [
        _datasource_var(),
        _query_var("namespace", "Namespace", f"label_values({first}, namespace)", multi=False),
        _query_var("pod", "Pod", f'label_values({first}{{namespace=~"$namespace"}}, pod)', multi=True),
    ]
    return _dashboard(
        "pagoda-operator",
        "Pagoda / Operator",
        "The Pagoda operator: InferenceDeployment conditions, reconcile rate, errors and latency, GPUs.",
        variables,
        lay.panels,
    )


DASHBOARDS = {"engine.json": engine_dashboard, "operator.json": operator_dashboard}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2) + "\n"


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "dashboards"
    out.mkdir(exist_ok=True)
    for name in DASHBOARDS:
        (out / name).write_text(render(name))
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
