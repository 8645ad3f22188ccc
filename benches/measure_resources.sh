#!/usr/bin/env bash
# Memory and CPU of the real agent (`fabricgate run`) over a window at the default interval,
# the figures the DaemonSet's resource requests/limits are based on.
#
#   benches/measure_resources.sh [SECONDS]          # default 600 (10 minutes)
#
# FABRICGATE_BIN  the binary (default: target/release/fabricgate, else target/debug/fabricgate;
#                 the image ships the release build, so measure that one)
# SYSFS_ROOT      sysfs to probe (default: tests/fixtures/ndr-8x400-healthy/sys, a real-layout
#                 8x400G InfiniBand node)
# PROC_ROOT       procfs (default: /proc, this machine's real mount table)
# INTERVAL        probe interval (default: 10s, the agent's default)
# MODE            run (default) or check (a proxy: one `fabricgate check` per interval)
#
# The agent runs with --dry-run and no kubeconfig (it needs no cluster), --verbs off (no RDMA
# hardware here). Samples VmRSS every 5 s from /proc/PID/status; at the end reads VmHWM and
# utime+stime from /proc/PID/stat and, where a cgroup can be made (root), the exact CPU of
# the agent's own cgroup. Prints one summary block.
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

SYSFS_ROOT=${SYSFS_ROOT:-tests/fixtures/ndr-8x400-healthy/sys}
[ -d "$SYSFS_ROOT/class/infiniband" ] || { echo "no sysfs tree at $SYSFS_ROOT" >&2; exit 2; }
# Absolute, as in a pod (--sysfs-root /host/sys): a relative root costs a getcwd per resolved path.
SYSFS_ROOT=$(realpath "$SYSFS_ROOT")

unset KUBECONFIG KUBERNETES_SERVICE_HOST KUBERNETES_SERVICE_PORT

# MODE=check: a proxy for builds without `run`: one `fabricgate check` per interval, each
# measured by GNU time (max RSS, user+sys CPU). It has no metrics server, no async runtime and
# no Kubernetes client, so it understates the agent's memory.
if [ "${MODE:-run}" = check ]; then
    secs=$(printf '%s' "$INTERVAL" | sed -E 's/s$//')
    end=$((SECONDS + DURATION))
    while [ "$SECONDS" -lt "$end" ]; do
        /usr/bin/time -a -o "$work/times" -f '%U %S %M' \
            "$FABRICGATE_BIN" check --verbs off --sysfs-root "$SYSFS_ROOT" \
            --proc-root "$PROC_ROOT" --format json >/dev/null || true
        sleep "$secs"
    done
    awk -v dur="$DURATION" -v bin="$FABRICGATE_BIN" -v iv="$INTERVAL" '
        { n++; cpu += $1 + $2; if ($3 > max) max = $3 }
        END {
            printf "binary           %s check (proxy; every %s for %d s, %d probes)\n", bin, iv, dur, n
            printf "peak RSS         %.1f MiB (largest single check)\n", max/1024
            printf "CPU (user+sys)   %.2f s total, %.1f ms per probe = %.2f millicores average\n", cpu, cpu/n*1000, cpu/dur*1000
        }' "$work/times"
    exit 0
fi

NODE_NAME=measure-node "$FABRICGATE_BIN" run --dry-run --verbs off \
    --sysfs-root "$SYSFS_ROOT" --proc-root "$PROC_ROOT" \
    --interval "$INTERVAL" --metrics-addr 127.0.0.1:0 \
    >"$work/agent.log" 2>&1 &
agent_pid=$!
# Exact CPU where a cgroup can be made (cgroup v1 cpuacct.usage or v2 cpu.stat, in ns/us, every
# thread including the short-lived ones): utime+stime are sampled in 10 ms ticks, which for an
# agent that runs ~2 ms a second is a statistical estimate, off by tens of percent over minutes.
cg_kind=none
cg_dir=
if [ -w /sys/fs/cgroup/cpuacct ] && [ -f /sys/fs/cgroup/cpuacct/cpuacct.usage ]; then
    cg_kind=v1; cg_dir=/sys/fs/cgroup/cpuacct/fabricgate-measure-$$
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then
    cg_kind=v2; cg_dir=/sys/fs/cgroup/fabricgate-measure-$$
fi
if [ "$cg_kind" != none ]; then
    if mkdir "$cg_dir" 2>/dev/null && echo "$agent_pid" >"$cg_dir/cgroup.procs" 2>/dev/null; then
        :
    else
        rmdir "$cg_dir" 2>/dev/null || true
        cg_kind=none
    fi
fi
cg_cpu_ns() {
    case "$cg_kind" in
        v1) cat "$cg_dir/cpuacct.usage" ;;
        v2) awk '/^usage_usec/ {printf "%d\n", $2 * 1000}' "$cg_dir/cpu.stat" ;;
    esac
}
cleanup_cg() {
    cleanup
    if [ "$cg_kind" != none ]; then
        while read -r p; do echo "$p" >"$(dirname "$cg_dir")/cgroup.procs" 2>/dev/null || true; done \
            <"$cg_dir/cgroup.procs" 2>/dev/null || true
        rmdir "$cg_dir" 2>/dev/null || true
    fi
}
trap cleanup_cg EXIT
cg0=$(cg_cpu_ns || true)

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
cg1=$(cg_cpu_ns || true)
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
        printf "CPU (utime+stime) %.2f s (user %.2f s, sys %.2f s) = %.2f millicores average\n", cpu, ut/hz, st/hz, cpu/dur*1000
    }'
if [ -n "$cg0" ] && [ -n "$cg1" ]; then
    # The window starts at the agent's start, as utime+stime do (its first probe included).
    awk -v ns=$((cg1 - cg0)) -v dur="$DURATION" -v k="$cg_kind" 'BEGIN {
        printf "CPU (cgroup %s)   %.3f s = %.2f millicores average (exact accounting)\n", k, ns / 1e9, ns / 1e6 / dur
    }'
fi
echo "agent log lines: $(wc -l <"$work/agent.log")"
