#!/usr/bin/env bash
# Prepare everything the Soft-RoCE VM needs, once, into a cache folder:
#   $CACHE/<pkg>.deb           the Debian kernel package (downloaded once)
#   $CACHE/kroot/              the package unpacked, with modules.dep (depmod -b)
#   $CACHE/initrd.gz           busybox-static + virtio/9p modules + /init
#   $CACHE/vm.env              KVER, KROOT, KERNEL, INITRD for run.sh
# Idempotent: a second run only checks the stamps. Host packages come from .ci/vm.sh.
# Cache: $FABRICGATE_VM_CACHE, default tests/vm/cache/ (gitignored).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${FABRICGATE_VM_CACHE:-$here/cache}"
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"

need() {
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || {
            echo "setup.sh: '$tool' not found; run .ci/vm.sh (apt-get install qemu-system-x86 busybox-static cpio kmod ...)" >&2
            exit 1
        }
    done
}
need qemu-system-x86_64 cpio gzip depmod modprobe dpkg
# The initramfs has no libc: only a static busybox (package busybox-static) works there.
BUSYBOX=""
for cand in /bin/busybox /usr/bin/busybox "$(command -v busybox || true)"; do
    if [ -x "$cand" ] && ! ldd "$cand" >/dev/null 2>&1; then
        BUSYBOX="$cand"
        break
    fi
done
[ -n "$BUSYBOX" ] || {
    echo "setup.sh: a static busybox is needed (apt-get install busybox-static)" >&2
    exit 1
}

# 1. The kernel package: the exact version linux-image-amd64 points at (a glob would fetch
#    every version), or FABRICGATE_VM_KERNEL_PKG; reuse a cached .deb when offline.
pkg="${FABRICGATE_VM_KERNEL_PKG:-}"
if [ -z "$pkg" ]; then
    pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')"
fi
deb=""
if [ -n "$pkg" ]; then
    deb="$(ls "$CACHE/${pkg}"_*.deb 2>/dev/null | head -1 || true)"
    if [ -z "$deb" ]; then
        echo "setup.sh: downloading $pkg into $CACHE" >&2
        (cd "$CACHE" && apt-get download "$pkg" >&2)
        deb="$(ls "$CACHE/${pkg}"_*.deb | head -1)"
    fi
else
    deb="$(ls "$CACHE"/linux-image-*-amd64_*.deb 2>/dev/null | head -1 || true)"
fi
[ -n "$deb" ] || {
    echo "setup.sh: no kernel package: apt-cache knows no linux-image-amd64 and $CACHE has no .deb" >&2
    exit 1
}

# 2. Unpack it and index its modules.
KROOT="$CACHE/kroot"
if [ ! -f "$KROOT/.stamp" ] || [ "$(cat "$KROOT/.stamp")" != "$(basename "$deb")" ]; then
    rm -rf "$KROOT"
    dpkg -x "$deb" "$KROOT"
    KVER="$(ls "$KROOT/lib/modules" | head -1)"
    depmod -b "$KROOT" "$KVER"
    basename "$deb" >"$KROOT/.stamp"
    rm -f "$CACHE/initrd.gz"
fi
KVER="$(ls "$KROOT/lib/modules" | head -1)"
KERNEL="$KROOT/boot/vmlinuz-$KVER"
[ -f "$KERNEL" ] || { echo "setup.sh: $KERNEL missing in $deb" >&2; exit 1; }
for m in rdma_rxe crc32_generic; do
    modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" >/dev/null || {
        echo "setup.sh: $deb has no $m module" >&2
        exit 1
    }
done

# 3. The initramfs: busybox, the modules to reach the host root over virtio-9p, and /init.
INITRD="$CACHE/initrd.gz"
if [ ! -f "$INITRD" ] || [ "$here/init.sh" -nt "$INITRD" ] || [ "$here/setup.sh" -nt "$INITRD" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work"/{bin,dev,proc,sys,root,modules}
    cp "$BUSYBOX" "$work/bin/busybox"
    : >"$work/modules.order"
    for m in virtio_pci virtio_net 9pnet_virtio 9p; do
        modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
    done | awk '!seen[$0]++' | while read -r ko; do
        cp "$ko" "$work/modules/"
        basename "$ko" >>"$work/modules.order"
    done
    cp "$here/init.sh" "$work/init"
    chmod 755 "$work/init" "$work/bin/busybox"
    (cd "$work" && find . | cpio -o -H newc --quiet | gzip -1) >"$INITRD.tmp"
    mv "$INITRD.tmp" "$INITRD"
fi

cat >"$CACHE/vm.env" <<ENV
KVER=$KVER
KROOT=$KROOT
KERNEL=$KERNEL
INITRD=$INITRD
ENV
echo "$CACHE/vm.env"
