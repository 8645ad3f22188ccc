#!/usr/bin/env bash
# Memory and CPU of the real agent (`fabricgate run`) over a window at the default interval,
# the figures the DaemonSet's resource requests/limits are based on.
#
#   benches/measure_resources.sh [SECONDS]          # default 600 (10 minutes)
#
# FABRICGATE_BIN  the binary (default: target/release/fabricgate, else target/debug/fabricgate;
#                 the image ships the release build, so measure that one)
# SYSFS_ROOT      sysfs to probe (default: a generated tree of 8 InfiniBand 400G ports and 2
#                 RoCE 200G ports on mlx5 devices, laid out like the real /sys)
# PROC_ROOT       procfs (default: /proc, this machine's real mount table)
# INTERVAL        probe interval (default: 10s, the agent's default)
#
# The agent runs with --dry-run and no kubeconfig (it needs no cluster), --verbs off (no RDMA
# hardware here). Samples VmRSS every 5 s from /proc/PID/status; at the end reads VmHWM and
# utime+stime from /proc/PID/stat. Prints one summary block.
set -euo pipefail

cd "$(dirname "$0")/.."
DURATION=${1:-600}
INTERVAL=${INTERVAL:-10s}
PROC_ROOT=${PROC_ROOT:-/proc}

if [ -z "${FABRICGATE_BIN:-}" ]; then
    for b in target/release/fabricgate target/debug/fabricgate; do
        if [ -x "$b" ]; then FABRICGATE_BIN=$b; break; fi
    done
fi
[ -x "${FABRICGATE_BIN:-}" ] || { echo "no fabricgate binary; cargo build --release" >&2; exit 2; }

work=$(mktemp -d)
agent_pid=
cleanup() {
    if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
        kill "$agent_pid"
        wait "$agent_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# A sysfs tree shaped like a real 8x400G IB + 2x200G RoCE node: class/infiniband/<dev> links
# into devices/pci..., ports with state, rate, counters, hw_counters and GIDs.
make_sysfs() {
    local root=$1 i dev pci port dir
    mkdir -p "$root/class/infiniband" "$root/class/net"
    for i in $(seq 0 9); do
        dev=mlx5_$i
        pci=0000:$(printf '%02x' $((0x17 + i))):00.0
        dir=$root/devices/pci0000:00/$pci
        mkdir -p "$dir/infiniband/$dev/ports/1"/{counters,hw_counters,gids,gid_attrs/types,gid_attrs/ndevs}
        printf '32.0 GT/s PCIe\n' >"$dir/current_link_speed"
        printf '32.0 GT/s PCIe\n' >"$dir/max_link_speed"
        printf '16\n' >"$dir/current_link_width"
        printf '16\n' >"$dir/max_link_width"
        printf '%d\n' $((i / 5)) >"$dir/numa_node"
        ln -s "../../../$pci" "$dir/infiniband/$dev/device"
        ln -s "../../devices/pci0000:00/$pci/infiniband/$dev" "$root/class/infiniband/$dev"
        local d=$dir/infiniband/$dev
        printf '1: CA\n' >"$d/node_type"
        printf 'b83f:d203:00%02x:1a2b\n' "$i" >"$d/node_guid"
        printf 'b83f:d203:00%02x:1a2b\n' "$i" >"$d/sys_image_guid"
        printf '28.39.1002\n' >"$d/fw_ver"
        printf 'MT4129\n' >"$d/hca_type"
        printf 'MT_0000000838\n' >"$d/board_id"
        port=$d/ports/1
        printf '4: ACTIVE\n' >"$port/state"
        printf '5: LinkUp\n' >"$port/phys_state"
        if [ "$i" -lt 8 ]; then
            printf '400 Gb/sec (4X NDR)\n' >"$port/rate"
            printf 'InfiniBand\n' >"$port/link_layer"
            printf '0x%x\n' $((i + 10)) >"$port/lid"
            printf '0x1\n' >"$port/sm_lid"
            printf 'fe80:0000:0000:0000:b83f:d203:00%02x:1a2b\n' "$i" >"$port/gids/0"
        else
            printf '200 Gb/sec (4X HDR)\n' >"$port/rate"
            printf 'Ethernet\n' >"$port/link_layer"
            printf '0x0\n' >"$port/lid"
            printf '0x0\n' >"$port/sm_lid"
            printf 'fe80:0000:0000:0000:ba3f:d2ff:fe03:%04x\n' "$i" >"$port/gids/0"
            printf '0000:0000:0000:0000:0000:ffff:0a00:%04x\n' "$i" >"$port/gids/1"
            printf 'IB/RoCE v1\n' >"$port/gid_attrs/types/0"
            printf 'RoCE v2\n' >"$port/gid_attrs/types/1"
            printf 'ens%df0np0\n' "$i" >"$port/gid_attrs/ndevs/0"
            printf 'ens%df0np0\n' "$i" >"$port/gid_attrs/ndevs/1"
        fi
        for c in excessive_buffer_overrun_errors link_downed link_error_recovery \
            local_link_integrity_errors multicast_rcv_packets multicast_xmit_packets \
            port_rcv_constraint_errors port_rcv_data port_rcv_errors port_rcv_packets \
            port_rcv_remote_physical_errors port_rcv_switch_relay_errors \
            port_xmit_constraint_errors port_xmit_data port_xmit_discards port_xmit_packets \
            port_xmit_wait symbol_error unicast_rcv_packets unicast_xmit_packets VL15_dropped; do
            case $c in
                *_data | *_packets) printf '%d\n' $((RANDOM * 100000)) >"$port/counters/$c" ;;
                *) printf '0\n' >"$port/counters/$c" ;;
            esac
        done
        for c in duplicate_request implied_nak_seq_err local_ack_timeout_err np_cnp_sent \
            np_ecn_marked_roce_packets out_of_buffer out_of_sequence packet_seq_err \
            req_cqe_error req_remote_access_errors req_remote_invalid_request resp_cqe_error \
            resp_local_length_error rnr_nak_retry_err roce_adp_retrans rp_cnp_handled; do
            printf '0\n' >"$port/hw_counters/$c"
        done
        printf '10\n' >"$port/hw_counters/lifespan"
    done
}

if [ -z "${SYSFS_ROOT:-}" ]; then
    SYSFS_ROOT=$work/sys
    make_sysfs "$SYSFS_ROOT"
fi

unset KUBECONFIG KUBERNETES_SERVICE_HOST KUBERNETES_SERVICE_PORT
NODE_NAME=measure-node "$FABRICGATE_BIN" run --dry-run --verbs off \
    --sysfs-root "$SYSFS_ROOT" --proc-root "$PROC_ROOT" \
    --interval "$INTERVAL" --metrics-addr 127.0.0.1:0 \
    >"$work/agent.log" 2>&1 &
agent_pid=$!

clk_tck=$(getconf CLK_TCK)
samples=()
end=$((SECONDS + DURATION))
while [ "$SECONDS" -lt "$end" ]; do
    if ! kill -0 "$agent_pid" 2>/dev/null; then
        echo "the agent exited early:" >&2
        cat "$work/agent.log" >&2
        exit 1
    fi
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$agent_pid/status")
    samples+=("$rss")
    sleep 5
done
hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$agent_pid/status")
# Fields after the command name (which may hold spaces): utime is the 12th, stime the 13th.
read -r utime stime < <(sed 's/.*) //' "/proc/$agent_pid/stat" | awk '{print $12, $13}')
threads=$(awk '/^Threads:/ {print $2}' "/proc/$agent_pid/status")

printf '%s\n' "${samples[@]}" | awk -v hwm="$hwm" -v ut="$utime" -v st="$stime" \
    -v hz="$clk_tck" -v dur="$DURATION" -v bin="$FABRICGATE_BIN" -v iv="$INTERVAL" \
    -v thr="$threads" '
    { n++; s += $1; if (min == "" || $1 < min) min = $1; if ($1 > max) max = $1 }
    END {
        cpu = (ut + st) / hz
        printf "binary           %s (interval %s, %d s, %d samples, %d threads)\n", bin, iv, dur, n, thr
        printf "RSS (VmRSS)      min %.1f MiB  avg %.1f MiB  max %.1f MiB\n", min/1024, s/n/1024, max/1024
        printf "peak (VmHWM)     %.1f MiB\n", hwm/1024
        printf "CPU (utime+stime) %.2f s user %.2f s sys %.2f s = %.2f millicores average\n", cpu, ut/hz, st/hz, cpu/dur*1000
    }'
echo "agent log lines: $(wc -l <"$work/agent.log")"
