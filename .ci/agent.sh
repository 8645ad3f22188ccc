#!/usr/bin/env bash
# CI needs of the agent tests (tests/agent.rs, tests/cluster.rs): the tests signal the agent
# with kill(1), which Debian ships in procps. The real control plane they talk to is built by
# .ci/controlplane.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
apt_install procps
