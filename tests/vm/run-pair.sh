#!/usr/bin/env bash
# Boot two Soft-RoCE test VMs on one private qemu network and run SCRIPT in both (as root, in
# a chroot of this host's root file system, read-only, cwd = the current directory), with
# FG_ROLE=a in one and FG_ROLE=b in the other; power both off.
#
#   tests/vm/run-pair.sh [-t SECONDS] -o OUTDIR SCRIPT
#
# Networking never leaves this machine: each link is a qemu socket netdev over 127.0.0.1 (VM a
# listens, VM b connects), so the guests' frames travel inside the two qemu processes.
#   eth0  169.254.77.1/24 (a) / .2 (b): carries rxe0; the link scenarios take down
#   eth1  169.254.78.1/24 (a) / .2 (b): management (the peers' TCP side channel), stays up
# (two /24s, not one /16: with both NICs in one subnet, RoCE packets of rxe0 and the side
# channel took either NIC and sessions failed intermittently)
# OUTDIR/a and OUTDIR/b are each guest's output share (/tmp/fg-out: stdout, stderr, rc,
# console.log); OUTDIR/sync is shared by both (the guest mounts it at /tmp/fg-sync with 9p tag
# fgsync) for marker files that order the two guests' steps. Exit status: 0 when both guest
# scripts exited 0, else the first failure (124 on the hard timeout, 125 no report).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
timeout_s=600
out=""
while getopts "t:o:" opt; do
    case "$opt" in
        t) timeout_s="$OPTARG" ;;
        o) out="$OPTARG" ;;
        *) echo "usage: $0 [-t SECONDS] -o OUTDIR SCRIPT" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 1 ] && [ -n "$out" ] || { echo "usage: $0 [-t SECONDS] -o OUTDIR SCRIPT" >&2; exit 2; }
script="$1"
[ -f "$script" ] || { echo "run-pair.sh: no such script: $script" >&2; exit 2; }

envfile="$("$here/setup.sh")"
# shellcheck disable=SC1090
. "$envfile"

mkdir -p "$out"
out="$(cd "$out" && pwd)"
mkdir -p "$out/a" "$out/b" "$out/sync"

# Two free loopback ports for the socket links (the kernel picks them; qemu binds them next).
read -r p0 p1 < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s:
    x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])
')

prepare() {
    role="$1"
    d="$out/$role"
    rm -f "$d"/{stdout,stderr,rc,console.log}
    cp "$script" "$d/guest.sh"
    {
        printf 'export FG_CWD=%q FG_KROOT=%q FG_KVER=%q FG_VM_DIR=%q FG_OUT=/tmp/fg-out FG_ROLE=%q\n' \
            "$PWD" "$KROOT" "$KVER" "$here" "$role"
        while IFS='=' read -r name _; do
            case "$name" in
                FG_CWD | FG_KROOT | FG_KVER | FG_VM_DIR | FG_OUT | FG_ROLE) ;;
                FG_*) printf 'export %s=%q\n' "$name" "${!name}" ;;
            esac
        done < <(env)
    } >"$d/env.sh"
}

boot() {
    role="$1" mode="$2" mac0="$3" mac1="$4"
    timeout -k 5 "$timeout_s" qemu-system-x86_64 \
        -accel tcg -cpu max -m 1024 -smp 1 \
        -nographic -no-reboot -monitor none -serial stdio \
        -kernel "$KERNEL" -initrd "$INITRD" \
        -append "console=ttyS0 quiet loglevel=3 panic=-1" \
        -virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap" \
        -virtfs "local,path=$out/$role,mount_tag=fgout,security_model=none" \
        -virtfs "local,path=$out/sync,mount_tag=fgsync,security_model=none" \
        -virtfs "local,path=$PWD,mount_tag=fgcwd,security_model=passthrough,readonly=on,multidevs=remap" \
        -netdev "socket,id=n0,$mode=127.0.0.1:$p0" -device "virtio-net-pci,netdev=n0,mac=$mac0" \
        -netdev "socket,id=n1,$mode=127.0.0.1:$p1" -device "virtio-net-pci,netdev=n1,mac=$mac1" \
        </dev/null >"$out/$role/console.log" 2>&1
}

prepare a
prepare b
rc_a=0
rc_b=0
boot a listen 52:54:00:fa:b0:01 52:54:00:fa:b1:01 &
pid_a=$!
# b connects: give a's qemu a moment to listen (connect fails outright otherwise).
for _ in $(seq 50); do
    ss -ltn 2>/dev/null | grep -q "127.0.0.1:$p1 " && break
    sleep 0.1
done
boot b connect 52:54:00:fa:b0:02 52:54:00:fa:b1:02 &
pid_b=$!
wait "$pid_a" || rc_a=$?
wait "$pid_b" || rc_b=$?

status=0
for role in a b; do
    d="$out/$role"
    qrc=$rc_a
    [ "$role" = b ] && qrc=$rc_b
    if [ -f "$d/rc" ]; then
        grc="$(cat "$d/rc")"
        if [ "$grc" != 0 ]; then
            echo "run-pair.sh: guest $role exited $grc; see $d/stderr and $d/console.log" >&2
            tail -20 "$d/stderr" >&2 || true
            [ "$status" = 0 ] && status="$grc"
        fi
    elif [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
        echo "run-pair.sh: VM $role did not finish within ${timeout_s}s; console: $d/console.log" >&2
        tail -20 "$d/console.log" >&2
        [ "$status" = 0 ] && status=124
    else
        echo "run-pair.sh: VM $role never reported (qemu exit $qrc); console: $d/console.log" >&2
        tail -20 "$d/console.log" >&2
        [ "$status" = 0 ] && status=125
    fi
done
exit "$status"
