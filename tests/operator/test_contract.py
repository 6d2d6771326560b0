"""No invalid InferenceDeployment becomes a pod: what the engine would refuse (its own dry run says so) is a
Ready=False condition and an Event, with the engine's words."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.operator.contract import REASON
from pagoda_testkit import STS, Cluster, running_operator

pytestmark = pytest.mark.timeout(120)


def cr(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


LLAMA_8B = {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}
L4 = {"product": "NVIDIA-L4", "count": 1}
REFUSED = {
    # the user's utilization leaves too little for the planned context on an L4: the engine's KV fit refuses
    "too-little-memory": (
        cr("too-little-memory", model=LLAMA_8B, gpu=L4, engine={"gpuMemoryUtilization": 0.75}),
        REASON,
        "does not fit in the KV cache",
    ),
    # a revision that cannot name a branch, tag or commit: EngineConfig refuses it
    "bad-revision": (
        cr("bad-revision", model={**LLAMA_8B, "revision": "../../main"}, gpu=L4),
        REASON,
        "revision must name a branch, tag or commit",
    ),
    # a revision of a source that has none: the operator refuses it before rendering
    "revision-of-a-pvc": (
        cr("revision-of-a-pvc", model={"source": "pvc://models/llama", "revision": "v1"}, gpu=L4),
        "InvalidSpec",
        "applies to hf:// sources only",
    ),
}


@pytest.mark.asyncio
async def test_what_the_engine_would_refuse_never_becomes_a_pod(cluster: Cluster) -> None:
    await cluster.add_node("gpu-l4-1", "l4")
    async with running_operator(cluster):
        for body, _, _ in REFUSED.values():
            await cluster.create(body)
        for name, (_, reason, words) in REFUSED.items():
            await cluster.wait_for(
                lambda n=name, r=reason: cluster.condition(n, "Ready").get("reason") == r,
                what=f"{name}: {reason}",
            )
            ready = cluster.condition(name, "Ready")
            assert ready["status"] == "False" and words in ready["message"], ready
            assert cluster.get(STS, "default", name) is None
        await cluster.settle()
        for name, (_, reason, _) in REFUSED.items():
            assert [e["reason"] for e in cluster.events(name) if e["type"] == "Warning"] == [reason]


@pytest.mark.asyncio
async def test_a_model_shape_in_the_crds_names_is_served(cluster: Cluster) -> None:
    """spec.model.shape as the CRD spells it (camelCase; a real API server prunes anything else)."""
    shape = {
        "numLayers": 32, "numAttentionHeads": 32, "numKvHeads": 8, "headDim": 128, "hiddenSize": 4096,
        "intermediateSize": 14336, "vocabSize": 128256, "maxPositionEmbeddings": 131072, "dtype": "bfloat16",
    }  # fmt: skip
    await cluster.add_node("gpu-l4-1", "l4")
    async with running_operator(cluster):
        await cluster.create(
            cr(
                "own-llama",
                model={"source": "pvc://models/my-llama", "shape": shape},
                gpu=L4,
                workload={"targetContext": 8192},
            )
        )
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", "own-llama"), what="StatefulSet")
        await cluster.settle()
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "/models/models/my-llama" and args[args.index("--device") + 1] == "cuda"
    assert int(args[args.index("--max-model-len") + 1]) == 8192


def test_pagoda_render_refuses_what_the_engine_would(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml
    from pagoda.operator.render_cli import main as render_main

    body, _, words = REFUSED["too-little-memory"]
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(body))
    assert render_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "spec.engine: the engine would refuse to start with this plan" in err and words in err
