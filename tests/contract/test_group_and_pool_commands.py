"""Issue 43's pods run commands the engine accepts: every rank of a LeaderWorkerSet group (the leader and each
worker, $(VAR) expanded as LeaderWorkerSet and the kubelet do) and each pool of spec.disaggregation, as
rendered, through `pagoda serve --dry-run` as real processes; the router of two pools through the router's
own check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pagoda.engine.cli.serve_args import build_parser
from pagoda.engine.cli.serve_check import check
from pagoda.operator import render
from pagoda.operator.contract import check_router_args, dry_run_argv
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import parse_spec
from pagoda_testkit import node

PAGODA = str(Path(sys.executable).parent / "pagoda")
KNOWN_FLAGS = {o for a in build_parser()._actions for o in a.option_strings}


def body(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns1"}, "spec": {"gpu": {"count": 0}, **spec}}


def dry_run(args: list[str]) -> dict[str, Any]:
    flags = {a for a in args if a.startswith("--")}
    assert flags <= KNOWN_FLAGS, sorted(flags - KNOWN_FLAGS)
    r = subprocess.run([PAGODA, "serve", *args, "--dry-run"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    ("parallelism", "ranks_per_pod"), [({"pipeline": 2}, 1), ({"pipeline": 4, "nodes": 2}, 2)]
)
def test_every_rank_of_a_group_passes_the_dry_run_as_a_process(parallelism: dict, ranks_per_pod: int) -> None:
    b = body("grp", parallelism=parallelism)
    spec = parse_spec(b["spec"])
    decision = decide(spec, {})
    commands = render.engine_commands(b, spec, decision)
    assert len(commands) == decision.nnodes
    for rank, (what, args) in enumerate(commands):
        config = dry_run(args)["config"]
        assert (config["node_rank"], config["headless"]) == (rank, rank > 0), what
        assert config["nnodes"] == decision.nnodes
        assert config["pipeline_parallel_size"] == parallelism["pipeline"]
        assert config["master_addr"] == "grp-0.grp.ns1" and config["master_port"] == render.MASTER_PORT
        world = config["pipeline_parallel_size"] * config["tensor_parallel_size"]
        assert world // config["nnodes"] == ranks_per_pod


def test_both_pools_pass_the_dry_run_with_their_kv_roles() -> None:
    b = body("pd", disaggregation={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    spec = parse_spec(b["spec"])
    roles = {}
    for what, args in render.engine_commands(b, spec, decide(spec, {})):
        roles[what] = json.loads(dry_run(args)["config"]["kv_transfer_config"])
    assert roles == {
        "the prefill pool": {"kv_connector": "PagodaConnector", "kv_role": "kv_producer", "kv_port": 14579},
        "the decode pool": {"kv_connector": "PagodaConnector", "kv_role": "kv_consumer"},
    }


def test_the_router_of_two_pools_passes_the_routers_check() -> None:
    """The router of two pools (--prefill-backend-dns) goes through the router's own parser and check."""
    from pagoda.router.cli import build_parser as router_parser

    b = body("pd", disaggregation={"prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    args = render.router_args(b, parse_spec(b["spec"]))
    check_router_args(args)
    known = {o for a in router_parser()._actions for o in a.option_strings}
    flags = {a for a in args if a.startswith("--")}
    assert flags <= known
    assert args[args.index("--prefill-backend-dns") + 1] == "pd-prefill-headless.ns1.svc.cluster.local:8000"
    assert args[args.index("--backend-dns") + 1] == "pd-decode-headless.ns1.svc.cluster.local:8000"


H100_NODES = pools(g for g in (node_gpus(node(f"gpu-h100-{i}", "h100")) for i in range(2)) if g)


def test_a_model_larger_than_a_node_passes_the_dry_run_on_every_rank() -> None:
    b = {
        "metadata": {"name": "l405", "namespace": "default"},
        "spec": {"model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct"},
                 "gpu": {"product": "H100", "count": 8}, "workload": {"targetContext": 8192}},
    }  # fmt: skip
    spec = parse_spec(b["spec"])
    decision = decide(spec, H100_NODES)
    assert decision.nnodes == 2
    for _, args in render.engine_commands(b, spec, decision):
        check(dry_run_argv(decision, args))
