#!/usr/bin/env bash
# CI needs of the metrics work: the real Prometheus binaries the tests run
# (promtool check metrics / check rules / test rules, a prometheus server scraping the
# agent), node_exporter and curl for benches/compare_node_exporter.sh.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
apt_install prometheus prometheus-node-exporter curl

# Debian's packages start their services on install where an init system runs; the tests
# start their own instances on random ports, so stop any packaged ones (harmless if absent).
for svc in prometheus prometheus-node-exporter; do
  if command -v systemctl >/dev/null 2>&1; then systemctl stop "$svc" 2>/dev/null || true; fi
done

promtool --version | head -1
prometheus --version 2>&1 | head -1
prometheus-node-exporter --version 2>&1 | head -1

# Rule files and their unit tests, also run from `cargo test --test metrics prometheus_rules`; here
# as a fast, readable first failure.
cd "$(dirname "$0")/.."
promtool check rules deploy/prometheus-rules.yaml
promtool test rules tests/prometheus/*.yaml
