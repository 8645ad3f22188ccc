# Sourced by guest scripts run through run.sh: helpers to bring up Soft-RoCE inside the VM.
# shellcheck shell=sh

# Load rdma_rxe (crc32_generic first: without it rxe fails with "failed to init crc32
# algorithm err:-2") and create rxe0 over eth0, with 10.0.2.15 (qemu user networking).
fg_rxe_up() {
    modprobe -d "$FG_KROOT" -S "$FG_KVER" crc32_generic || return 1
    modprobe -d "$FG_KROOT" -S "$FG_KVER" rdma_rxe || return 1
    ip link set lo up
    ip link set eth0 up || return 1
    ip addr add 10.0.2.15/24 dev eth0 2>/dev/null || true
    ip route add default via 10.0.2.2 2>/dev/null || true
    # eth1: management network to the host (10.0.3.2), independent of eth0's fate.
    ip link set eth1 up 2>/dev/null && ip addr add 10.0.3.15/24 dev eth1 2>/dev/null
    rdma link add rxe0 type rxe netdev eth0 || return 1
    fg_wait_port ACTIVE 10
}

# fg_wait_port STATE SECONDS: wait until rxe0 port 1 reports STATE in sysfs.
fg_wait_port() {
    i=0
    while [ "$i" -lt $(($2 * 10)) ]; do
        grep -q "$1" /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && return 0
        sleep 0.1
        i=$((i + 1))
    done
    echo "rxe0 port 1 did not reach $1 within $2 s (state: $(cat /sys/class/infiniband/rxe0/ports/1/state 2>&1))" >&2
    return 1
}

# timing NAME VALUE: one line NAME=VALUE in $FG_OUT/timings.env, which the host test reads.
timing() { echo "$1=$2" >>"$FG_OUT/timings.env"; }

# Monotonic-ish milliseconds (uptime has 10 ms resolution, enough for second-scale timings).
fg_now_ms() {
    awk '{printf "%d\n", $1 * 1000}' /proc/uptime
}

# fg_wait_host NAME SECONDS: wait for the host's acknowledgement file $FG_OUT/host.NAME
# (the host watches the real kube-apiserver); fails on timeout or host.abort.
fg_wait_host() {
    i=0
    while [ "$i" -lt $(($2 * 10)) ]; do
        [ -e "$FG_OUT/host.$1" ] && return 0
        [ -e "$FG_OUT/host.abort" ] && { echo "host aborted while we waited for $1" >&2; return 1; }
        sleep 0.1
        i=$((i + 1))
    done
    echo "no host.$1 within $2 s" >&2
    return 1
}
