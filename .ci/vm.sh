#!/usr/bin/env bash
# CI needs of the Soft-RoCE VM suites (tests/vm/softroce_vm.rs, tests/vm/peers_vm.rs): qemu, a static
# busybox for the initramfs, kmod for depmod/modprobe -d, iproute2 for `rdma link`, the verbs
# userland, perftest (ib_write_lat/ib_write_bw next to fabricgate's figures), curl and time
# (used inside the guests), and the Debian kernel package (downloaded once into
# tests/vm/cache/ or $FABRICGATE_VM_CACHE).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
apt_install \
    qemu-system-x86 busybox-static cpio kmod iproute2 util-linux gzip \
    rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev \
    perftest curl time \
    pkg-config libclang-dev clang cmake libnl-3-dev libnl-route-3-dev
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Download and unpack the kernel, build the initramfs (cached; a no-op the second time).
"$here/tests/vm/setup.sh"
