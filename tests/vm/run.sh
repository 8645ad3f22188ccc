#!/usr/bin/env bash
# Boot the Soft-RoCE test VM, run SCRIPT inside it (as root, in a chroot of this host's root
# file system, read-only, cwd = the current directory) and power off.
#
#   tests/vm/run.sh [-t SECONDS] [-o OUTDIR] SCRIPT
#
# The current directory (the checkout) is also shared on its own and mounted at the same path
# after the guest's tmpfs mounts, so a checkout under /tmp, /run or /var/tmp stays visible.
# OUTDIR (a fresh temp dir by default) is writable from the guest at /tmp/fg-out and ends up
# holding stdout, stderr, rc and console.log (the serial console). Variables named FG_* are
# passed into the guest, plus FG_KROOT/FG_KVER (the kernel tree, for `modprobe -d`) and
# FG_VM_DIR (this folder, for guest-lib.sh). The script's stdout and stderr are replayed here;
# the exit status is the guest script's, or 124 when the hard timeout (default 240 s) killed
# the VM, or 125 when the guest never reported.
#
# Two NICs, each on its own qemu user network: eth0 (10.0.2.0/24) carries rxe0 and is the one
# scenarios take down; eth1 (10.0.3.0/24) stays up for management, and 10.0.3.2:PORT reaches
# this host's 127.0.0.1:PORT (e.g. the test kube-apiserver) even while eth0 is down.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/vm/host-lib.sh
. "$here/host-lib.sh"
vm_args 240 "[-t SECONDS] [-o OUTDIR] SCRIPT" 0 "$@"
vm_kernel

if [ -z "$out" ]; then
    out="$(mktemp -d "${TMPDIR:-/tmp}/fabricgate-vm.XXXXXX")"
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
rm -f "$out"/{stdout,stderr,rc,console.log}
cp "$script" "$out/guest.sh"
vm_guest_env "$out/env.sh"

rc=0
vm_boot "$timeout_s" 2 "$out" "$out/console.log" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
    -netdev user,id=n1,net=10.0.3.0/24 -device virtio-net-pci,netdev=n1 \
    || rc=$?

[ -f "$out/stdout" ] && cat "$out/stdout"
[ -f "$out/stderr" ] && cat "$out/stderr" >&2
if [ -f "$out/rc" ]; then
    exit "$(cat "$out/rc")"
fi
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "run.sh: the VM did not finish within ${timeout_s}s and was killed; console: $out/console.log" >&2
    tail -20 "$out/console.log" >&2
    exit 124
fi
echo "run.sh: the guest never reported a result (qemu exit $rc); console: $out/console.log" >&2
tail -20 "$out/console.log" >&2
exit 125
