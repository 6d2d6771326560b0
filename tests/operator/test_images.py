"""The engine-image allow-list: how references and patterns match, and the operator enforcing it."""

from __future__ import annotations

import pytest
from pagoda.operator.cli import parse_args
from pagoda.operator.images import image_allowed, normalize_image
from pagoda_testkit import INFD, STS, Cluster, example, running_operator


@pytest.mark.parametrize(
    ("image", "normal"),
    [
        ("nginx", "docker.io/library/nginx:latest"),
        ("team/app:1", "docker.io/team/app:1"),
        ("ghcr.io/pagoda-llm/pagoda-engine:0.1.0", "ghcr.io/pagoda-llm/pagoda-engine:0.1.0"),
        ("localhost:5000/engine", "localhost:5000/engine:latest"),
        ("registry.corp/engine@sha256:" + "a" * 64, "registry.corp/engine@sha256:" + "a" * 64),
    ],
)
def test_references_are_normalised_like_the_container_runtime_does(image: str, normal: str) -> None:
    assert normalize_image(image) == normal


ALLOWED = ["ghcr.io/pagoda-llm/pagoda-engine", "registry.corp/ml/*", "docker.io/library/python:3.12-*"]


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("ghcr.io/pagoda-llm/pagoda-engine:0.1.0", True),  # a repository without a tag: any tag
        ("ghcr.io/pagoda-llm/pagoda-engine@sha256:" + "b" * 64, True),  # ...or digest
        ("ghcr.io/pagoda-llm/pagoda-engine", True),
        ("ghcr.io/pagoda-llm/pagoda-engine-evil:1", False),  # not a prefix match
        ("ghcr.io/pagoda-llm/other:1", False),
        ("registry.corp/ml/engine:2", True),
        ("registry.corp/mlx/engine:2", False),
        ("python:3.12-slim", True),  # matched in its normalised form
        ("python:3.13", False),
        ("evil.example.com/registry.corp/ml/engine:1", False),
    ],
)
def test_allow_list_patterns(image: str, allowed: bool) -> None:
    assert image_allowed(image, ALLOWED) is allowed


def test_an_empty_allow_list_allows_everything() -> None:
    assert image_allowed("anything.example.com/x:1", [])


def test_the_cli_takes_the_allow_list() -> None:
    args = parse_args(["--allowed-image", "ghcr.io/pagoda-llm/*", "--allowed-image=registry.corp/ml/*"])
    assert args.allowed_image == ["ghcr.io/pagoda-llm/*", "registry.corp/ml/*"]
    assert parse_args([]).allowed_image == []


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_refuses_images_off_the_allow_list(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    allowed = ["registry.corp/ml/*"]
    async with running_operator(cluster, allowed_images=allowed):
        good = example("cpu-default-model.yaml")
        good["metadata"]["name"] = "good"
        good["spec"]["image"] = "registry.corp/ml/pagoda-engine:1"
        bad = example("cpu-default-model.yaml")
        bad["metadata"]["name"] = "bad"
        bad["spec"]["image"] = "evil.example.com/miner:latest"
        default = example("cpu-default-model.yaml")  # no spec.image: the operator's own engine image
        for obj in (good, bad, default):
            await cluster.create(obj)
        await cluster.wait_for(
            lambda: cluster.condition("bad", "Ready").get("reason") == "ImageNotAllowed",
            what="ImageNotAllowed",
        )
        message = cluster.condition("bad", "Ready")["message"]
        assert "spec.image" in message and "evil.example.com/miner:latest" in message
        assert "registry.corp/ml/*" in message
        assert cluster.condition("bad", "Ready")["status"] == "False"
        await cluster.wait_for(lambda: cluster.get(STS, "default", "good"), what="StatefulSet good")
        await cluster.wait_for(lambda: cluster.get(STS, "default", "smollm2-cpu"), what="StatefulSet default")
        await cluster.settle()
        assert cluster.get(STS, "default", "bad") is None
        assert [e["reason"] for e in cluster.events("bad") if e["type"] == "Warning"] == ["ImageNotAllowed"]

        # An allowed deployment switched to a refused image keeps running the image it had.
        await cluster.patch(INFD, "default", "good", {"spec": {"image": "evil.example.com/miner:latest"}})
        await cluster.wait_for(
            lambda: cluster.condition("good", "Ready").get("reason") == "ImageNotAllowed",
            what="ImageNotAllowed on the switched deployment",
        )
        await cluster.settle()
        sts = cluster.get(STS, "default", "good")
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.corp/ml/pagoda-engine:1"
