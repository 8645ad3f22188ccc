#!/usr/bin/env bash
# Builds the test control plane (tests/controlplane/: Kubernetes' own etcd, kube-apiserver,
# kube-scheduler and kubectl as one multi-call binary) from the Go module proxy, for the tests
# that talk to a real API server (tests/cluster.rs, tests/vm/softroce_vm.rs). Test
# infrastructure only: the product is Rust.
#
# Cached: the binary is rebuilt only when tests/controlplane/{go.mod,go.sum,*.go} change
# (their hash is stored beside it), so a warm CI run does not recompile Kubernetes. Go's module
# and build caches stay at their defaults (the same machine runs CI).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="$here/tests/controlplane"
dest=/opt/fabricgate-controlplane
version=v1.37.2

export DEBIAN_FRONTEND=noninteractive
. "$here/.ci/apt.bash"
# openssl makes the per-run CA and keys; curl polls /readyz.
if ! command -v openssl >/dev/null || ! command -v curl >/dev/null; then
    apt_install openssl curl ca-certificates
fi
if ! command -v go >/dev/null; then
    echo "controlplane: no 'go' on PATH; Go 1.26 is needed to build the test control plane" >&2
    exit 1
fi

stamp="$(cat "$src/go.mod" "$src/go.sum" "$src"/*.go | sha256sum | cut -d' ' -f1)"
if [ -x "$dest/bin/controlplane" ] && [ "$(cat "$dest/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "controlplane: up to date ($dest/bin/controlplane)"
    exit 0
fi
mkdir -p "$dest/bin"
started=$(date +%s)
(
    cd "$src"
    CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -gcflags=all=-dwarf=false \
        -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37" \
        -o "$dest/bin/controlplane.new" .
)
mv "$dest/bin/controlplane.new" "$dest/bin/controlplane"
echo "$stamp" > "$dest/stamp"
echo "controlplane: built $dest/bin/controlplane in $(( $(date +%s) - started )) s"
