#!/usr/bin/env bash
# Installs everything the test suite needs (`cargo test --workspace`): what building needs
# (scripts/setup.sh), then every per-area test setup in .ci/*.sh (the Go test control plane,
# the Soft-RoCE VM's qemu and kernel, FUSE, Prometheus, the manifest validators, the node
# tests' container images, ...), then rustfmt and clippy for CI's checks. Each .ci/*.sh is
# cached where it builds something, so a second run is quick. Idempotent; run as root (or it
# re-runs itself with sudo). CI (.ci/run) runs exactly this.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  exec sudo "$0" "$@"
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
"$here/scripts/setup.sh"
for extra in "$here"/.ci/*.sh; do
  [ -e "$extra" ] || continue
  started=$(date +%s)
  echo "setup-tests: $(basename "$extra")"
  bash "$extra"
  echo "setup-tests: $(basename "$extra") done in $(( $(date +%s) - started )) s"
done
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
