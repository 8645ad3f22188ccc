#!/usr/bin/env bash
# Render the default installation, deploy/overlays/shared-device, into daemonset.yaml.
# Edit the sources (deploy/base/, deploy/overlays/), then run this; a test checks that
# daemonset.yaml is exactly this output.
#
#   deploy/render.sh                      # uses kubectl from PATH (kubectl kustomize)
#   KUBECTL=/opt/fabricgate-controlplane/bin/controlplane\ kubectl deploy/render.sh
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a kubectl <<<"${KUBECTL:-kubectl}"
rendered=$("${kubectl[@]}" kustomize deploy/overlays/shared-device)
{
	cat deploy/rendered-header.txt
	printf '%s\n' "$rendered"
} >daemonset.yaml.tmp
mv daemonset.yaml.tmp daemonset.yaml
