#!/usr/bin/env bash
# Installs the system packages fabricgate needs to build, run and test on Debian/Ubuntu.
# Idempotent; run as root (or it re-runs itself with sudo).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  exec sudo "$0" "$@"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Build: libibverbs headers for the verbs probe (rdma-sys runs bindgen, hence libclang).
# Run: libibverbs + providers. Tests: see the per-area scripts under .ci/.
apt-get install -y -qq --no-install-recommends \
  ca-certificates gcc pkg-config libclang-dev libibverbs-dev librdmacm-dev \
  ibverbs-providers rdma-core python3 >/dev/null
here="$(cd "$(dirname "$0")/.." && pwd)"
for extra in "$here"/.ci/*.sh; do
  [ -e "$extra" ] || continue
  echo "setup: $(basename "$extra")"
  bash "$extra"
done
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
