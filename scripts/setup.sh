#!/usr/bin/env bash
# Installs the system packages fabricgate needs to build and run (`cargo run --release --
# check`) on Debian/Ubuntu: a C toolchain, libibverbs headers for the verbs probe (rdma-sys
# runs bindgen, hence libclang) and, to run, libibverbs + its providers. Nothing for the tests:
# scripts/setup-tests.sh installs those. Idempotent; run as root (or it re-runs itself with sudo).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  exec sudo "$0" "$@"
fi
export DEBIAN_FRONTEND=noninteractive
pkgs=(ca-certificates gcc libc6-dev pkg-config libclang-dev libibverbs-dev librdmacm-dev
  ibverbs-providers rdma-core)
# Already installed (dpkg status `ii`, every one): nothing to update or install.
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${db:Status-Abbrev}\n' "$p" 2>/dev/null | grep -q '^ii'; then
    # The test setups' apt lock (.ci/apt.bash): their Go lane may run an apt-get beside this one.
    (
        flock 8
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    ) 8>"${FABRICGATE_APT_LOCK:-/var/lock/fabricgate-apt.lock}"
    break
  fi
done
