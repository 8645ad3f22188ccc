#!/usr/bin/env bash
# Installs everything the test suite needs (`./scripts/test.sh`): what building needs
# (scripts/setup.sh), then every per-area test setup in .ci/*.sh (the Go test control plane,
# the Soft-RoCE VM's qemu and kernel, FUSE, Prometheus, the manifest validators, the node
# tests' container images, ...), then rustfmt and clippy for CI's checks. Each .ci/*.sh is
# cached where it builds something, so a second run is quick. Idempotent; run as root (or it
# re-runs itself with sudo). CI (.ci/run) runs exactly this.
#
# Two lanes at once (FABRICGATE_SETUP_SERIAL=1: one after the other): the Go builds
# (.ci/controlplane.sh, .ci/kueue.sh, then .ci/helm.sh: ~12.5 min of compiling on a new 2-core machine, needing
# only Go) beside every other setup in name order (packages, pip, downloads, the images: mostly
# waiting on the network and dpkg). Their output is prefixed with the script's name. apt runs
# one at a time (.ci/apt.bash). A failure in either lane fails the whole setup, after both
# stopped.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  exec sudo "$0" "$@"
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
"$here/scripts/setup.sh"
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

go_lane=(controlplane.sh kueue.sh helm.sh)
step() { # script: run one .ci setup, its lines prefixed, and say how long it took
  local name="$1" started rc=0
  started=$(date +%s)
  echo "setup-tests: $name"
  bash "$here/.ci/$name" 2>&1 | sed -u "s/^/$name: /" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "setup-tests: $name FAILED (exit $rc) after $(( $(date +%s) - started )) s" >&2
    return "$rc"
  fi
  echo "setup-tests: $name done in $(( $(date +%s) - started )) s"
}
in_go_lane() { local s; for s in "${go_lane[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

started=$(date +%s)
go_pid=
if [ "${FABRICGATE_SETUP_SERIAL:-}" != 1 ]; then
  # Its own process group (job control on for the start only), so that a failure elsewhere
  # stops the compilers under it too, never leaving a build running after this script.
  set -m
  (
    set -euo pipefail
    for name in "${go_lane[@]}"; do
      if [ -e "$here/.ci/$name" ]; then step "$name" || exit; fi
    done
  ) &
  go_pid=$!
  set +m
  trap 'if [ -n "$go_pid" ]; then kill -- "-$go_pid" 2>/dev/null || true; fi' EXIT
fi
rest_rc=0
(
  set -euo pipefail
  for extra in "$here"/.ci/*.sh; do
    [ -e "$extra" ] || continue
    name="$(basename "$extra")"
    if [ -n "$go_pid" ] && in_go_lane "$name"; then continue; fi
    step "$name" || exit   # (set -e does not apply inside a subshell under ||)
  done
) || rest_rc=$?
go_rc=0
if [ -n "$go_pid" ]; then
  if [ "$rest_rc" -ne 0 ]; then kill -- "-$go_pid" 2>/dev/null || true; fi
  wait "$go_pid" || go_rc=$?
  go_pid=
fi
if [ "$rest_rc" -ne 0 ] || [ "$go_rc" -ne 0 ]; then
  echo "setup-tests: failed (setups exit $rest_rc, Go lane exit $go_rc); see the lines above" >&2
  exit 1
fi
echo "setup-tests: everything ready in $(( $(date +%s) - started )) s"
