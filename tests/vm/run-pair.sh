#!/usr/bin/env bash
# Boot two Soft-RoCE test VMs on one private qemu network and run SCRIPT in both (as root, in
# a chroot of this host's root file system, read-only, cwd = the current directory), with
# FG_ROLE=a in one and FG_ROLE=b in the other; power both off.
#
#   tests/vm/run-pair.sh [-t SECONDS] -o OUTDIR SCRIPT
#
# Networking never leaves this machine: each link is a qemu UDP-tunnel netdev over 127.0.0.1,
# so the guests' frames travel between the two qemu processes only.
#   eth0  169.254.77.1/24 (a) / .2 (b): carries rxe0; the link scenarios take down
#   eth1  169.254.78.1/24 (a) / .2 (b): management (the peers' TCP side channel), stays up
#   eth2  only with FG_HOST_NET=1: each VM's own qemu user network (10.0.3.0/24), whose
#         10.0.3.2:PORT is this host's 127.0.0.1:PORT (the test kube-apiserver)
# (two /24s, not one /16: with both NICs in one subnet, RoCE packets of rxe0 and the side
# channel took either NIC and sessions failed intermittently)
# OUTDIR/a and OUTDIR/b are each guest's output share (/tmp/fg-out: stdout, stderr, rc,
# console.log); OUTDIR/sync is shared by both (the guest mounts it at /tmp/fg-sync with 9p tag
# fgsync) for marker files that order the two guests' steps. Exit status: 0 when both guest
# scripts exited 0, else the first failure (124 on the hard timeout, 125 no report).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/vm/host-lib.sh
. "$here/host-lib.sh"
vm_args 600 "[-t SECONDS] -o OUTDIR SCRIPT" 1 "$@"
vm_kernel

mkdir -p "$out"
out="$(cd "$out" && pwd)"
mkdir -p "$out/a" "$out/b" "$out/sync"

# Four free loopback UDP ports: each link is a UDP tunnel (qemu `-netdev socket,udp=`), one
# port per end. Not a TCP stream: when one guest sets its NIC down, its qemu stops reading the
# link, and a stream's sender then blocks in send() with the whole VM frozen (seen: a's qemu
# stuck in tcp_sendmsg after b's `ip link set eth0 down`); a datagram is dropped instead, as
# on a wire.
read -r a0 a1 b0 b1 < <(python3 -c '
import socket
s = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
for x in s:
    x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])
')

prepare() {
    role="$1"
    d="$out/$role"
    rm -f "$d"/{stdout,stderr,rc,console.log}
    cp "$script" "$d/guest.sh"
    vm_guest_env "$d/env.sh" "FG_ROLE=$role"
}

# boot ROLE LOCAL0 REMOTE0 LOCAL1 REMOTE1 MAC0 MAC1: the VM's two links are UDP tunnels from
# its LOCAL ports to the other VM's.
boot() {
    role="$1" l0="$2" r0="$3" l1="$4" r1="$5" mac0="$6" mac1="$7"
    vm_boot "$timeout_s" 1 "$out/$role" "$out/$role/console.log" \
        -virtfs "local,path=$out/sync,mount_tag=fgsync,security_model=none" \
        -netdev "socket,id=n0,udp=127.0.0.1:$r0,localaddr=127.0.0.1:$l0" \
        -device "virtio-net-pci,netdev=n0,mac=$mac0" \
        -netdev "socket,id=n1,udp=127.0.0.1:$r1,localaddr=127.0.0.1:$l1" \
        -device "virtio-net-pci,netdev=n1,mac=$mac1" \
        "${host_net[@]}"
}

host_net=()
if [ "${FG_HOST_NET:-}" = 1 ]; then
    host_net=(-netdev "user,id=n2,net=10.0.3.0/24" -device virtio-net-pci,netdev=n2)
fi

# The tunnels' host side, every 2 s while the VMs run: each qemu socket's queue and drop count
# (ss's skmem d), and the host's UDP counters (RcvbufErrors: datagrams a full socket dropped).
watch_host_net() {
    while :; do
        echo "=== $(date +%s%3N) ms"
        ss -uamn "( sport = :$a0 or sport = :$a1 or sport = :$b0 or sport = :$b1 )" 2>&1
        grep '^Udp:' /proc/net/snmp
        sleep 2
    done >"$out/host-net.log"
}

prepare a
prepare b
watch_host_net &
watcher=$!
trap 'kill "$watcher" 2>/dev/null || true' EXIT
rc_a=0
rc_b=0
boot a "$a0" "$b0" "$a1" "$b1" 52:54:00:fa:b0:01 52:54:00:fa:b1:01 &
pid_a=$!
boot b "$b0" "$a0" "$b1" "$a1" 52:54:00:fa:b0:02 52:54:00:fa:b1:02 &
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
