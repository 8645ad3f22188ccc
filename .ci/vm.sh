#!/usr/bin/env bash
# CI needs of the Soft-RoCE VM suite (tests/softroce_vm.rs): qemu, a static busybox for the
# initramfs, kmod for depmod/modprobe -d, iproute2 for `rdma link`, the verbs userland, and
# the Debian kernel package (downloaded once into tests/vm/cache/ or $FABRICGATE_VM_CACHE).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends \
    qemu-system-x86 busybox-static cpio kmod iproute2 util-linux gzip \
    rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev \
    pkg-config libclang-dev clang cmake libnl-3-dev libnl-route-3-dev
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Download and unpack the kernel, build the initramfs (cached; a no-op the second time).
"$here/tests/vm/setup.sh"
