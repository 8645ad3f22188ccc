#!/usr/bin/env bash
# Prerequisites of the storage tests (tests/storage_*.rs):
# - fuse3 + libfuse3-dev + pkg-config + gcc: tests/storage/storage_fuse.rs builds tests/fuse/hangfs.c,
#   a FUSE server whose statfs never answers, to create a real hung mount;
# - util-linux (mount, umount, unshare): tmpfs mounts, and the FUSE test's private mount
#   namespace.
# Under CI=true the root/FUSE tests fail (not skip) if any of this is missing.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
. "$(dirname "${BASH_SOURCE[0]}")/apt.bash"
apt_install fuse3 libfuse3-dev pkg-config gcc libc6-dev util-linux mount

# /dev/fuse must exist and be usable; create the node if the kernel has FUSE but udev did not.
if [ ! -e /dev/fuse ]; then
  modprobe fuse 2>/dev/null || true
  [ -e /dev/fuse ] || mknod -m 0666 /dev/fuse c 10 229
fi
chmod 0666 /dev/fuse

# A quick proof that FUSE mounting works here, so a broken machine fails with a clear message
# before the test suite does.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/ok.c" <<'C'
#define FUSE_USE_VERSION 31
#include <fuse.h>
int main(void) { return fuse_version() >= 30 ? 0 : 1; }
C
# shellcheck disable=SC2046
gcc "$tmp/ok.c" $(pkg-config --cflags --libs fuse3) -o "$tmp/ok"
"$tmp/ok"
echo "storage CI prerequisites ready: $(fusermount3 --version 2>&1 | head -1), /dev/fuse present"
