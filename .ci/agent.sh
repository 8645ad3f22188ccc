#!/usr/bin/env bash
# CI needs of the agent tests (tests/agent.rs). The API-server stand-in is in-process Rust and
# the fixture sysfs trees are built in tempdirs; the tests signal the agent with kill(1), which
# Debian ships in procps.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y procps
