#!/bin/busybox sh
# /init of the Soft-RoCE test VM: mount the host's root read-only over virtio-9p, chroot into
# it and run the job the host left in the writable `fgout` share, then power off. Anything
# going wrong ends in poweroff too, so the host never waits for its hard timeout needlessly.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do
    insmod "/modules/$m" || echo "init: insmod $m failed"
done </modules.order

die() {
    echo "FABRICGATE-VM: init failed: $*"
    poweroff -f
    exit 1
}

R=/root
opts=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$opts,ro,cache=loose" hostroot "$R" || die "cannot mount the host root (9p tag hostroot)"
mount -t proc proc "$R/proc" || die "proc"
mount -t sysfs sysfs "$R/sys" || die "sysfs"
mount -t devtmpfs devtmpfs "$R/dev" || die "devtmpfs"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts devpts "$R/dev/pts"
mount -t tmpfs tmpfs "$R/dev/shm"
mount -t tmpfs tmpfs "$R/tmp" || die "tmpfs /tmp"
mount -t tmpfs tmpfs "$R/run"
[ -d "$R/var/tmp" ] && mount -t tmpfs tmpfs "$R/var/tmp"
mkdir -p "$R/tmp/fg-out"
mount -t 9p -o "$opts" fgout "$R/tmp/fg-out" || die "cannot mount the output share (9p tag fgout)"
# The checkout, at its own path: the tmpfs mounts above would hide one under /tmp or /run.
cwd="$(. "$R/tmp/fg-out/env.sh" && echo "$FG_CWD")"
[ -n "$cwd" ] || die "no FG_CWD in env.sh"
mkdir -p "$R$cwd" 2>/dev/null
mount -t 9p -o "$opts,ro,cache=loose" fgcwd "$R$cwd" || die "cannot mount the checkout (9p tag fgcwd) at $cwd"

echo "FABRICGATE-VM: running job"
chroot "$R" /usr/bin/env -i HOME=/root TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c '. /tmp/fg-out/env.sh && cd "$FG_CWD" && exec /bin/sh /tmp/fg-out/guest.sh' \
    >"$R/tmp/fg-out/stdout" 2>"$R/tmp/fg-out/stderr"
echo $? >"$R/tmp/fg-out/rc"
echo "FABRICGATE-VM: job done, rc $(cat "$R/tmp/fg-out/rc")"
sync
umount "$R/tmp/fg-out"
poweroff -f
