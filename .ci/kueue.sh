#!/usr/bin/env bash
# Builds Kueue's manager (sigs.k8s.io/kueue, cmd/kueue) from the Go module proxy into the test
# control plane's bin directory, for the `kueue` tests in tests/cluster/kueue.rs (a real Kueue
# admitting batch/v1 Jobs through fabricgate's admission check). Test infrastructure only.
#
# v0.19.2 is the newest v0.19.x the module proxy serves here (v0.19.3/4 are refused). The module
# is built from a writable copy of the downloaded module (the module cache is read-only), and its
# CRDs and webhook configurations are copied beside the binary (`$dest/kueue/crd/`,
# `$dest/kueue/webhook/manifests.yaml`) so the tests install Kueue's own objects.
#
# Kueue without its internal certificate management (the tests give its webhook server a per-run
# certificate for 127.0.0.1) reads a metrics serving certificate from the fixed path
# /etc/kueue/metrics/certs/tls.{crt,key} and exits without one; the tests turn the metrics
# server off, but the file must parse: a self-signed pair is made there once if none exists.
#
# Cached: rebuilt only when the version or this script changes (their hash is stored beside the
# binary). A cold build takes ~6 min on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dest=/opt/fabricgate-controlplane
version=v0.19.2
module=sigs.k8s.io/kueue

if ! command -v go >/dev/null; then
    echo "kueue: no 'go' on PATH; Go 1.26 is needed to build Kueue for the tests" >&2
    exit 1
fi

# openssl makes the metrics certificate (and the control plane's PKI).
. "$here/.ci/apt.bash"
if ! command -v openssl >/dev/null; then
    apt_install openssl
fi
metrics_certs=/etc/kueue/metrics/certs
if [ ! -s "$metrics_certs/tls.crt" ] || [ ! -s "$metrics_certs/tls.key" ]; then
    mkdir -p "$metrics_certs"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
        -subj /CN=kueue-metrics-test -keyout "$metrics_certs/tls.key" \
        -out "$metrics_certs/tls.crt" 2>/dev/null
    echo "kueue: made a self-signed metrics certificate in $metrics_certs"
fi

stamp="$( (echo "$module@$version"; cat "$here/.ci/kueue.sh") | sha256sum | cut -d' ' -f1)"
if [ -x "$dest/bin/kueue" ] && [ -d "$dest/kueue/crd" ] && [ -f "$dest/kueue/webhook/manifests.yaml" ] \
    && [ "$(cat "$dest/kueue/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "kueue: up to date ($dest/bin/kueue)"
    exit 0
fi
started=$(date +%s)
moddir="$(go mod download -json "$module@$version" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
if [ -z "$moddir" ] || [ ! -d "$moddir/cmd/kueue" ]; then
    echo "kueue: go mod download $module@$version gave no module directory" >&2
    exit 1
fi
work="$(mktemp -d /tmp/kueue-build.XXXXXX)"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
cp -r "$moddir" "$work/src"
chmod -R u+w "$work/src"
mkdir -p "$dest/bin" "$dest/kueue"
(
    cd "$work/src"
    CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -gcflags=all=-dwarf=false \
        -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
        -o "$dest/bin/kueue.new" ./cmd/kueue
)
rm -rf "$dest/kueue/crd.new"
cp -r "$moddir/config/components/crd/bases" "$dest/kueue/crd.new"
chmod -R u+w "$dest/kueue/crd.new"
rm -rf "$dest/kueue/crd"
mv "$dest/kueue/crd.new" "$dest/kueue/crd"
mkdir -p "$dest/kueue/webhook"
cp "$moddir/config/components/webhook/manifests.yaml" "$dest/kueue/webhook/manifests.yaml"
chmod u+w "$dest/kueue/webhook/manifests.yaml"
mv "$dest/bin/kueue.new" "$dest/bin/kueue"
echo "$version" > "$dest/kueue/version"
echo "$stamp" > "$dest/kueue/stamp"
echo "kueue: built $dest/bin/kueue ($version) in $(( $(date +%s) - started )) s"
