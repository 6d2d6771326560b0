"""The chart's crds/ is a copy of the repository's crds/ (the one source of truth), kept by sync-crds.sh."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import yaml

# chart-only CRDs: kopf's peering kinds, which the top-level crds/ (Pagoda's own API) does not carry
CHART_ONLY = {"kopf-peerings.yaml"}


def test_chart_crds_match_the_source_of_truth(helm):
    source = helm.root / "crds"
    copy = helm.chart / "crds"
    src_files = {p.name: p.read_bytes() for p in source.glob("*.yaml")}
    chart_files = {p.name: p.read_bytes() for p in copy.glob("*.yaml")}
    assert src_files, "crds/ holds no CRD yet"
    missing = sorted(set(src_files) - set(chart_files))
    extra = sorted(set(chart_files) - set(src_files) - CHART_ONLY)
    drifted = sorted(n for n in set(src_files) & set(chart_files) if src_files[n] != chart_files[n])
    assert not (missing or extra or drifted), (
        f"charts/pagoda/crds drifted from crds/: missing {missing}, extra {extra}, different {drifted}. "
        "Run charts/pagoda/sync-crds.sh"
    )


def test_sync_script_restores_a_drifted_copy(helm, tmp_path):
    """Run the real script on a scratch copy of the layout: it copies new/changed CRDs and drops stale ones."""
    root = tmp_path / "repo"
    chart = root / "charts" / "pagoda"
    shutil.copytree(helm.root / "crds", root / "crds")
    (chart / "crds").mkdir(parents=True)
    shutil.copy(helm.chart / "sync-crds.sh", chart / "sync-crds.sh")
    (chart / "crds" / "kopf-peerings.yaml").write_text("kept\n")
    (chart / "crds" / "stale.yaml").write_text("gone\n")
    name = next((root / "crds").glob("*.yaml")).name
    (chart / "crds" / name).write_text("drifted\n")
    subprocess.run(["bash", str(chart / "sync-crds.sh")], check=True, capture_output=True)
    assert (chart / "crds" / name).read_bytes() == (root / "crds" / name).read_bytes()
    assert not (chart / "crds" / "stale.yaml").exists()
    assert (chart / "crds" / "kopf-peerings.yaml").read_text() == "kept\n"


def test_chart_crds_are_valid_crds(helm):
    for path in sorted((helm.chart / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            assert doc["kind"] == "CustomResourceDefinition", path.name
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_inference_deployment_crd_ships_in_the_chart(helm):
    names = {o["metadata"]["name"] for o in helm.render() if o["kind"] == "CustomResourceDefinition"}
    assert "inferencedeployments.pagoda.dev" in names
