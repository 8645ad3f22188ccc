# Runtime transport per pod (issue 42), run in both VMs of tests/vm/run-pair.sh by
# tests/vm/transport_vm.rs. In VM a, two "pods" are real cgroups under a kubepods-shaped
# cgroup v2 path (systemd driver naming, pod UIDs of the test's choosing):
#   - the RDMA pod: ibv_rc_pingpong over rxe0 to b, an RC QP in RTS moving traffic;
#   - the sockets pod: bulk TCP to b's address on eth0, the very netdev under rxe0 (the
#     IPoIB-like case: the RDMA port's own link carries the TCP).
# Then `fabricgate check --format json --pods-window 5s` (and the table) in a, the shipped
# binary, with nothing of Kubernetes around. b serves the pingpong and swallows the TCP.
# The guests order their steps with marker files in the shared folder /tmp/fg-sync.
# Needs FG_BIN (the fabricgate binary).
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
# shellcheck source=tests/vm/pair-lib.sh
. "$FG_VM_DIR/pair-lib.sh"
: >"$O/timings.env"

RDMA_POD=7d1e5a3c-2b4f-4c6d-8e9f-0a1b2c3d4e5f
TCP_POD=9a8b7c6d-5e4f-4a3b-9c2d-1e0f2a3b4c5d
TCP_PORT=5001

fg_pair_up
# The TCP socket diagnostics (sock_diag) the pods section reads: a real kernel loads tcp_diag on
# first use; here the modules are not in /lib/modules, so load it from the kernel tree.
modprobe -d "$FG_KROOT" -S "$FG_KVER" tcp_diag || fail "modprobe tcp_diag"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add"
fg_wait_port ACTIVE 30 || fail "rxe0 not ACTIVE"

fg_wait_roce_v2_gid
log "rxe0 ACTIVE, GID index $GIDX"
mark up
wait_for "$PEER_ROLE" up 240

if [ "$ROLE" = b ]; then
    # The TCP sink on eth0's address, and the pingpong's server; both until a is done.
    python3 -c '
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(4)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.close()
' "169.254.77.$ME" "$TCP_PORT" >"$O/sink.log" 2>&1 &
    sink=$!
    ibv_rc_pingpong -e -d rxe0 -g "$GIDX" -n 100000000 >"$O/pingpong-server.log" 2>&1 &
    server=$!
    sleep 1
    mark ready
    wait_for a done 600
    kill "$sink" "$server" 2>/dev/null
    log "done"
    exit 0
fi

# --- a: the two pods ----------------------------------------------------------------------
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || mountpoint -q /sys/fs/cgroup ||
    fail "cannot mount cgroup2 at /sys/fs/cgroup"
# container QOS UID ID: create the container scope of pod UID (systemd driver); its path.
container() {
    u="$(echo "$2" | tr - _)"
    d="/sys/fs/cgroup/kubepods.slice/kubepods-$1.slice/kubepods-$1-pod$u.slice/cri-containerd-$3.scope"
    mkdir -p "$d" && echo "$d"
}
rdma_ctr="$(container besteffort "$RDMA_POD" 4a1c7e2b9d3f5a6c8e0b2d4f6a8c0e1f3a5c7e9b1d3f5a7c9e0b2d4f6a8c0e1f)" ||
    fail "cannot create the RDMA pod's cgroup"
tcp_ctr="$(container burstable "$TCP_POD" 6e2a9c4b1d7f3a5e8c0b2d4f6a8e1c3b5d7f9a0c2e4b6d8f1a3c5e7b9d0f2a4c)" ||
    fail "cannot create the sockets pod's cgroup"
wait_for b ready 120

# The RDMA pod: the shell joins the container's cgroup, then becomes the pingpong client (its
# TCP handshake goes over eth1, the side channel; its data over rxe0).
sh -c 'echo $$ >"$1/cgroup.procs" && exec ibv_rc_pingpong -e -d rxe0 -g "$2" -n 100000000 "$3"' \
    sh "$rdma_ctr" "$GIDX" "169.254.78.$OTHER" >"$O/pingpong-client.log" 2>&1 &
rdma_pid=$!
i=0
until rdma res show qp | grep "type RC state RTS" | grep -q "pid $rdma_pid "; do
    [ "$i" -ge 600 ] && { rdma res show qp >&2; fail "no RC QP in RTS for pid $rdma_pid within 60 s"; }
    sleep 0.1
    i=$((i + 1))
done
log "rdma pod: pid $rdma_pid holds an RC QP in RTS"

# The sockets pod: bulk TCP to b's eth0 address, through eth0 (rxe0's netdev).
t_tcp=$(fg_now_ms)
sh -c 'echo $$ >"$1/cgroup.procs" && exec python3 -c "
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(1 << 16)
while True:
    s.sendall(block)
" "$2" "$3"' sh "$tcp_ctr" "169.254.77.$OTHER" "$TCP_PORT" >"$O/tcp-pod.log" 2>&1 &
tcp_pid=$!
i=0
until grep -qx "$tcp_pid" "$tcp_ctr/cgroup.procs"; do
    [ "$i" -ge 100 ] && fail "pid $tcp_pid did not join $tcp_ctr"
    sleep 0.1
    i=$((i + 1))
done
log "sockets pod: pid $tcp_pid sending to 169.254.77.$OTHER:$TCP_PORT"

cat >/tmp/transport.yaml <<EOF
rdma:
  devices: "rxe*"
  min_active_ports: 1
  link_layer: Ethernet
runtime:
  enabled: true
  tcp_min_bytes_per_second: 1000000
EOF
# rxe0's packet counters around the check: the RC QP really moves data meanwhile.
hw=/sys/class/infiniband/rxe0/ports/1/hw_counters
cat "$hw/sent_pkts" >"$O/rxe_sent_before"
"$FG_BIN" check --config /tmp/transport.yaml --format json --pods-window 5s \
    >"$O/check.json" 2>"$O/check.stderr"
echo $? >"$O/check.rc"
t_done=$(fg_now_ms)
cat "$hw/sent_pkts" >"$O/rxe_sent_after"
timing detect_ms $((t_done - t_tcp))
log "check --format json: rc $(cat "$O/check.rc"), $((t_done - t_tcp)) ms after the first bulk TCP"
"$FG_BIN" check --config /tmp/transport.yaml --pods-window 5s >"$O/check.txt" 2>&1
echo $? >"$O/check_table.rc"
"$FG_BIN" check --config /tmp/transport.yaml --format json --pods off >"$O/check_off.json" 2>&1
echo $? >"$O/check_off.rc"

# What the facts were, from the kernel's own tools, for the host-side assertions.
rdma res show qp >"$O/rdma-res-show-qp.txt" 2>&1
echo "$rdma_pid" >"$O/rdma_pid"
echo "$tcp_pid" >"$O/tcp_pid"
ss -tin "dst 169.254.77.$OTHER" >"$O/ss.txt" 2>&1
cat /proc/net/dev >"$O/net_dev.txt"
kill "$rdma_pid" "$tcp_pid" 2>/dev/null
mark done
log "done"
