#!/usr/bin/env bash
# Builds Helm (helm.sh/helm/v4, cmd/helm) from the Go module proxy into the test control
# plane's bin directory, for the chart's tests (tests/cluster/helm.rs: `helm lint`, `helm
# template`, `helm install`/`upgrade`/`uninstall` against the real control plane). Test
# infrastructure only; no prebuilt binary is downloaded.
#
# The module is built from a writable copy of the downloaded module (the module cache is
# read-only), as .ci/kueue.sh does.
#
# Cached: rebuilt only when the version or this script changes (their hash is stored beside the
# binary).
set -euo pipefail
dest=/opt/fabricgate-controlplane
version=v4.3.2
module=helm.sh/helm/v4
here="$(cd "$(dirname "$0")/.." && pwd)"

if ! command -v go >/dev/null; then
    echo "helm: no 'go' on PATH; Go 1.26 is needed to build Helm for the tests" >&2
    exit 1
fi
stamp="$( (echo "$module@$version"; cat "$here/.ci/helm.sh") | sha256sum | cut -d' ' -f1)"
if [ -x "$dest/bin/helm" ] && [ "$(cat "$dest/helm.stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "helm: up to date ($dest/bin/helm)"
    exit 0
fi
started=$(date +%s)
moddir="$(go mod download -json "$module@$version" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
if [ -z "$moddir" ] || [ ! -d "$moddir/cmd/helm" ]; then
    echo "helm: go mod download $module@$version gave no module directory" >&2
    exit 1
fi
work="$(mktemp -d /tmp/helm-build.XXXXXX)"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
cp -r "$moddir" "$work/src"
chmod -R u+w "$work/src"
mkdir -p "$dest/bin"
(
    cd "$work/src"
    CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -gcflags=all=-dwarf=false \
        -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
        -o "$dest/bin/helm.new" ./cmd/helm
)
mv "$dest/bin/helm.new" "$dest/bin/helm"
echo "$stamp" > "$dest/helm.stamp"
echo "helm: built $dest/bin/helm ($version) in $(( $(date +%s) - started )) s"
