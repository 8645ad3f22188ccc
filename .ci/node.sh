#!/usr/bin/env bash
# Prerequisites of the real-node tests (tests/node.rs, tests/node/): containerd 1.6 + runc run
# the pods a real kubelet (tests/controlplane's `kubelet` subcommand, v1.37.x) starts in the
# test node's own mount and network namespace; the CNI bridge + host-local plugins give pods an
# address there; umoci + gcc build the local pause and Debian stand-in images (no registry is
# reachable), mmdebstrap makes the Debian root file system. buildah, skopeo, uidmap and
# fuse-overlayfs build the project's image from the unchanged Dockerfile (.ci/image.sh uses the
# same packages). iproute2/util-linux: veth pair, unshare/nsenter, mount. jq: deploy/cleanup-nodes.sh.
# Under CI=true every node test fails (not skips) when any of this is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
for cmd in containerd ctr runc buildah mmdebstrap umoci skopeo unshare nsenter ip gcc jq; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
[ -x /usr/lib/cni/bridge ] || need+=(cni)
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
if [ "${#need[@]}" -gt 0 ]; then
  apt_install \
    containerd runc buildah mmdebstrap umoci skopeo containernetworking-plugins uidmap \
    fuse-overlayfs golang-github-containers-common iptables iproute2 util-linux \
    gcc libc6-dev ca-certificates jq
fi
# Debian's containerd package starts a service where an init system runs; the tests start
# their own containerd inside the node namespace, with their own config and root.
if command -v systemctl >/dev/null 2>&1; then systemctl stop containerd 2>/dev/null || true; fi
echo "node CI prerequisites ready: $(containerd --version | cut -d' ' -f2-3), $(runc --version | head -1)"
