# Sourced by the two-VM scenario scripts run through run-pair.sh (peers-scenarios.sh,
# gang-scenarios.sh, transport-scenarios.sh), after guest-lib.sh: the steps both VMs share.
# It sets ROLE (a or b, from FG_ROLE), PEER_ROLE (the other), ME and OTHER (1 or 2: this VM's
# and the other's address suffix), O (FG_OUT) and S (the shared sync folder).
# The VMs and the host order their steps with marker files S/WHO.NAME; WHO.abort means WHO
# gave up.
# shellcheck shell=sh

O="$FG_OUT"
S=/tmp/fg-sync
ROLE="$FG_ROLE"
if [ "$ROLE" = a ]; then ME=1 OTHER=2 PEER_ROLE=b; else ME=2 OTHER=1 PEER_ROLE=a; fi

log() { echo "[$ROLE $(fg_now_ms)] $*" >>"$O/steps.log"; }
mark() { : >"$S/$ROLE.$1"; log "mark $1"; }
fail() {
    log "FAIL: $*"
    dmesg >"$O/dmesg.log" 2>&1
    echo "$ROLE: $*" >&2
    : >"$S/$ROLE.abort"
    exit 1
}
# wait_for WHO NAME SECONDS: until S/WHO.NAME exists; fails when the other VM or the host
# aborted, or after SECONDS.
wait_for() {
    i=0
    while [ "$i" -lt $(($3 * 10)) ]; do
        [ -e "$S/$1.$2" ] && return 0
        [ -e "$S/$PEER_ROLE.abort" ] && fail "the other VM aborted while we waited for $1.$2"
        [ -e "$S/host.abort" ] && fail "the host aborted while we waited for $1.$2"
        sleep 0.1
        i=$((i + 1))
    done
    fail "no $1.$2 within $3 s"
}

# fg_pair_up: mount the sync folder, load Soft-RoCE, address lo, eth0 (169.254.77.ME, rxe0's
# netdev) and eth1 (169.254.78.ME, the side channel).
fg_pair_up() {
    mkdir -p "$S"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 fgsync "$S" || fail "cannot mount fgsync"
    modprobe -d "$FG_KROOT" -S "$FG_KVER" crc32_generic || fail "modprobe crc32_generic"
    modprobe -d "$FG_KROOT" -S "$FG_KVER" rdma_rxe || fail "modprobe rdma_rxe"
    ip link set lo up
    ip link set eth0 up && ip addr add "169.254.77.$ME/24" dev eth0 || fail "eth0"
    ip link set eth1 up && ip addr add "169.254.78.$ME/24" dev eth1 || fail "eth1"
}

# fg_roce_v2_gid: the index of rxe0 port 1's RoCE v2 GID that maps our eth0 address
# (169.254.77.ME); fg_wait_roce_v2_gid sets GIDX to it, waiting for it up to 20 s.
fg_roce_v2_gid() {
    want="0000:0000:0000:0000:0000:ffff:a9fe:4d0$ME"
    for f in /sys/class/infiniband/rxe0/ports/1/gids/*; do
        n="${f##*/}"
        if [ "$(cat "$f" 2>/dev/null)" = "$want" ] &&
            grep -q "RoCE v2" "/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$n" 2>/dev/null; then
            echo "$n"
            return 0
        fi
    done
    return 1
}
fg_wait_roce_v2_gid() {
    i=0
    while [ "$i" -lt 200 ]; do
        GIDX="$(fg_roce_v2_gid)" && return 0
        sleep 0.1
        i=$((i + 1))
    done
    fail "no RoCE v2 GID for 169.254.77.$ME on rxe0"
}

# fg_net_watch: every 2 s until S/ROLE.done, append to O/net.log what a link failure between
# the VMs would show: the NICs' packet and drop counters, the ARP table (flags 0x0: not
# resolved), the kernel's UDP counters (rxe0 speaks UDP) and rxe0's own counters. One awk a
# round: under emulation every process started costs the guest a noticeable slice of its CPU.
# A failed run is read from it, and from the host's side in OUTDIR/host-net.log (run-pair.sh).
fg_net_watch() {
    (
        while [ ! -e "$S/$ROLE.done" ] && [ ! -e "$S/$ROLE.abort" ]; do
            echo "=== $(fg_now_ms) ms" >>"$O/net.log"
            awk '
                FILENAME ~ /hw_counters/ {
                    n = FILENAME; sub(/.*\//, "", n); printf "%s=%s ", n, $0; next
                }
                FNR == 1 { print "-- " FILENAME }
                { print }
                END { print "" }
            ' /proc/net/dev /proc/net/arp /proc/net/snmp \
                /sys/class/infiniband/rxe0/ports/1/hw_counters/* >>"$O/net.log" 2>&1
            sleep 2
        done
    ) &
}
