#!/usr/bin/env bash
# Copies the CRDs from the repository's crds/ (the one source of truth) into the chart's crds/.
# tests/chart/test_crds_sync.py fails when the two drift apart; run this after changing crds/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../../crds"
dst="$here/crds"
mkdir -p "$dst"
# drop chart copies whose source is gone (kopf-peerings.yaml is chart-only and stays)
for f in "$dst"/*.yaml; do
  [ -e "$f" ] || continue
  name="$(basename "$f")"
  [ "$name" = "kopf-peerings.yaml" ] && continue
  [ -e "$src/$name" ] || { rm -f "$f"; echo "removed $name"; }
done
for f in "$src"/*.yaml; do
  [ -e "$f" ] || continue
  cp "$f" "$dst/$(basename "$f")"
  echo "synced $(basename "$f")"
done
