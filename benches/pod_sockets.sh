#!/usr/bin/env bash
# One pod holding N loopback TCP sockets (default 300,000), and what `fabricgate check --pods`
# costs over it: its peak RSS and CPU time for one window (two samples `--pods-window` apart),
# with `runtime.max_sockets_per_pod` at its default (65,536) and raised past N (every socket
# counted). The pod is real as far as the sampler can tell: its processes sit in a kubepods
# cgroup (`kubepods/besteffort/pod<uid>/<container>`, the cgroupfs driver's shape) and in a
# network namespace of their own (`ip netns`). Open files are capped at 20,000 per process
# here, so the sockets are spread over processes of ~9,900 connections (19,800 sockets) each.
#
#   benches/pod_sockets.sh [N] [BINARY]      # as root; BINARY: target/test-image/fabricgate
#   BEFORE=/path/to/an/older/fabricgate benches/pod_sockets.sh   # and that one over the same pod
#
# Everything it made (namespace, cgroups, processes) is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-300000}"
bin="${2:-target/test-image/fabricgate}"
[ -x "$bin" ] || { echo "no $bin: cargo build --profile test-image --bin fabricgate" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run as root (ip netns, cgroups)" >&2; exit 1; }
uid=5e7b2a10-0c1d-4e2f-8a3b-9c4d5e6f7a80
cid=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
ns=fg-pod-sockets
per=9900
procs=$(((n / 2 + per - 1) / per))
cgroups=()
for root in /sys/fs/cgroup/unified /sys/fs/cgroup/pids /sys/fs/cgroup; do
    if [ -d "$root" ] && [ -w "$root" ] && [ -f "$root/cgroup.procs" ]; then
        cgroups+=("$root/kubepods/besteffort/pod$uid/$cid")
        break
    fi
done
[ "${#cgroups[@]}" -gt 0 ] || { echo "no writable cgroup hierarchy" >&2; exit 1; }
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for c in "${cgroups[@]}"; do
        d="$c"
        while [ "$d" != "${d%/kubepods*}" ]; do rmdir "$d" 2>/dev/null || true; d=$(dirname "$d"); done
    done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
for c in "${cgroups[@]}"; do mkdir -p "$c"; done
cat >"$work/hold.py" <<'EOF'
import os, socket, sys, time
n = int(sys.argv[1])
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4096)
port = ls.getsockname()[1]
held = []
for _ in range(n):
    c = socket.create_connection(("127.0.0.1", port))
    s, _ = ls.accept()
    held.append((c, s))
open(sys.argv[2], "w").write("ready\n")
time.sleep(3600)
EOF
left=$((n / 2))
for i in $(seq 1 "$procs"); do
    this=$((left < per ? left : per))
    left=$((left - this))
    ip netns exec "$ns" python3 "$work/hold.py" "$this" "$work/ready.$i" &
    pids+=($!)
    for c in "${cgroups[@]}"; do echo "$!" >"$c/cgroup.procs"; done
done
for i in $(seq 1 "$procs"); do
    until [ -f "$work/ready.$i" ]; do sleep 0.2; done
done
held=$(ip netns exec "$ns" ss -Htn state established | wc -l)
echo "pod $uid: $procs processes, $held established TCP sockets in netns $ns"
measure() {
    local label="$1" config="$2"
    /usr/bin/time -f "%M %U %S %e" -o "$work/time" "$bin" check --verbs off --pods on \
        --pods-window 5s --config "$config" >"$work/out" 2>&1 || true
    # GNU time puts "Command exited with non-zero status N" first (check exits 1 without RDMA).
    read -r rss user sys wall < <(tail -n 1 "$work/time")
    local why
    why=$(grep -m1 -o "more than [0-9]* TCP sockets[^;]*" "$work/out" || true)
    echo "$label: peak RSS $((rss / 1024)) MiB, CPU $(echo "$user + $sys" | bc) s (user $user, sys $sys), wall $wall s (two samples 5 s apart)${why:+; the pod: $why}"
}
printf 'runtime:\n  enabled: false\n' >"$work/default.yaml"
printf 'runtime:\n  max_sockets_per_pod: 10000000\n' >"$work/all.yaml"
measure "max_sockets_per_pod 65536 (default)" "$work/default.yaml"
measure "max_sockets_per_pod 10000000 (every socket counted)" "$work/all.yaml"
if [ -n "${BEFORE:-}" ]; then
    # Another build (e.g. of an earlier commit) over the same pod; it may not know the key.
    bin="$BEFORE"
    measure "BEFORE=$BEFORE" "$work/default.yaml"
fi
