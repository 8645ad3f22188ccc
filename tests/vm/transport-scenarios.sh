# Runtime transport per pod, run in both VMs of tests/vm/run-pair.sh by
# tests/vm/transport_vm.rs. In VM a, two "pods" are real cgroups under a kubepods-shaped
# cgroup v2 path (systemd driver naming, pod UIDs of the test's choosing):
#   - the RDMA pod: ibv_rc_pingpong over rxe0 to b, an RC QP in RTS moving traffic;
#   - the sockets pod: bulk TCP to b's address on eth0, the very netdev under rxe0 (the
#     IPoIB-like case: the RDMA port's own link carries the TCP).
# Then `fabricgate check --format json --pods-window 5s` (and the table) in a, the shipped
# binary, with nothing of Kubernetes around. b serves the pingpong and swallows the TCP.
# Then a third pod holds an idle RC QP (a pingpong stopped with SIGSTOP once in RTS):
#   - beside bulk TCP to b over eth0: `check` must call it SocketsBesideIdleQueuePairs;
#   - beside perftest's ib_write_bw to b from the same pod, run whole inside check's window:
#     the port's bytes in `check` must match what perftest says it moved.
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
    wait_for a phase1_done 600
    kill "$server" 2>/dev/null
    # The idle QP's peer, and perftest's server (their TCP handshakes on eth1, the side channel).
    ibv_rc_pingpong -e -d rxe0 -g "$GIDX" -p 18517 -n 100000000 >"$O/holder-server.log" 2>&1 &
    holder=$!
    timeout 300 ib_write_bw -d rxe0 -x "$GIDX" -p 18516 -s 65536 -n 200 -u 20 -F \
        >"$O/ib_write_bw-server.txt" 2>&1 &
    i=0
    while [ "$i" -lt 300 ] && ! ss -Hltn "sport = :18516" | grep -q .; do
        sleep 0.1
        i=$((i + 1))
    done
    grep -H . /sys/class/infiniband/rxe0/ports/1/hw_counters/* >"$O/hw_counters_phase2_before.txt" 2>&1
    mark phase2_ready
    wait_for a done 600
    grep -H . /sys/class/infiniband/rxe0/ports/1/hw_counters/* >"$O/hw_counters_phase2_after.txt" 2>&1
    kill "$sink" "$holder" 2>/dev/null
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

# pingpong_in CGROUP PORT LOG: a pingpong client to b in CGROUP (the shell joins the
# container's cgroup, then becomes the client; its TCP handshake goes over eth1, the side
# channel; its data over rxe0); its PID in $pinging once its RC QP is in RTS.
pingpong_in() {
    sh -c 'echo $$ >"$1/cgroup.procs" && exec ibv_rc_pingpong -e -d rxe0 -g "$2" -p "$4" -n 100000000 "$3"' \
        sh "$1" "$GIDX" "169.254.78.$OTHER" "$2" >"$3" 2>&1 &
    pinging=$!
    i=0
    until rdma res show qp | grep "type RC state RTS" | grep -q "pid $pinging "; do
        [ "$i" -ge 600 ] && { rdma res show qp >&2; fail "no RC QP in RTS for pid $pinging within 60 s"; }
        sleep 0.1
        i=$((i + 1))
    done
}

# The RDMA pod.
pingpong_in "$rdma_ctr" 18515 "$O/pingpong-client.log"
rdma_pid=$pinging
log "rdma pod: pid $rdma_pid holds an RC QP in RTS"

# push_tcp CGROUP LOG: bulk TCP to b's eth0 address (through eth0, rxe0's netdev) from a
# process of CGROUP; its PID in $pushed once it joined.
push_tcp() {
    sh -c 'echo $$ >"$1/cgroup.procs" && exec python3 -c "
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(1 << 16)
while True:
    s.sendall(block)
" "$2" "$3"' sh "$1" "169.254.77.$OTHER" "$TCP_PORT" >"$2" 2>&1 &
    pushed=$!
    i=0
    until grep -qx "$pushed" "$1/cgroup.procs"; do
        [ "$i" -ge 100 ] && fail "pid $pushed did not join $1"
        sleep 0.1
        i=$((i + 1))
    done
}

# The sockets pod.
t_tcp=$(fg_now_ms)
push_tcp "$tcp_ctr" "$O/tcp-pod.log"
tcp_pid=$pushed
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
mark phase1_done

# --- a: a pod with an idle RC QP ---------------------------------------------------------
IDLE_POD=5c4b3a29-1807-4f6e-9d5c-4b3a29180706
idle_ctr="$(container besteffort "$IDLE_POD" 2b4d6f8a0c1e3a5c7e9b1d3f5a7c9e0b2d4f6a8c0e1f3a5c7e9b1d3f5a7c9e0b)" ||
    fail "cannot create the idle-QP pod's cgroup"
wait_for b phase2_ready 120
# The holder: a pingpong client whose RC QP reaches RTS and is then stopped (SIGSTOP): the QP
# stays in RTS and moves nothing, like a QP NCCL left behind or a decoy.
pingpong_in "$idle_ctr" 18517 "$O/holder-client.log"
holder=$pinging
kill -STOP "$holder"
# What was in flight when it stopped completes in the kernel.
sleep 2
log "idle-QP pod: pid $holder holds an RC QP in RTS, stopped"
echo "$holder" >"$O/holder_pid"

# Beside it, bulk TCP to b over eth0 from the same pod.
push_tcp "$idle_ctr" "$O/idle-tcp.log"
idle_tcp=$pushed
cat "$hw/sent_pkts" >"$O/rxe_sent_idle_before"
"$FG_BIN" check --config /tmp/transport.yaml --format json --pods-window 5s \
    >"$O/check_idle.json" 2>"$O/check_idle.stderr"
echo $? >"$O/check_idle.rc"
cat "$hw/sent_pkts" >"$O/rxe_sent_idle_after"
kill "$idle_tcp" 2>/dev/null
log "check beside the idle QP: rc $(cat "$O/check_idle.rc")"

# perftest from the same pod, whole inside check's window (started once check says it took
# its first sample; -n 200 of 64 KiB ends in seconds even under emulation). -u 20: an ACK
# timeout of 4 s, not perftest's 67 ms, which an emulated peer descheduled on a loaded host
# misses: the requester then resends what was in flight, and the wire (and so the port's
# counters) carries more than perftest wrote.
cat "$hw/sent_pkts" >"$O/rxe_sent_bw_before"
grep -H . "$hw"/* >"$O/hw_counters_bw_before.txt" 2>&1
"$FG_BIN" check --config /tmp/transport.yaml --format json --pods-window 20s \
    >"$O/check_bw.json" 2>"$O/check_bw.stderr" &
check_pid=$!
i=0
until grep -q "^pods: first sample" "$O/check_bw.stderr"; do
    [ "$i" -ge 900 ] && fail "check took no first pods sample within 90 s"
    sleep 0.1
    i=$((i + 1))
done
t_bw=$(fg_now_ms)
sh -c 'echo $$ >"$1/cgroup.procs" && exec timeout 15 ib_write_bw -d rxe0 -x "$2" -p 18516 -s 65536 -n 200 -u 20 -F "$3"' \
    sh "$idle_ctr" "$GIDX" "169.254.78.$OTHER" >"$O/ib_write_bw.txt" 2>&1
echo $? >"$O/ib_write_bw.rc"
timing perftest_ms $(($(fg_now_ms) - t_bw))
wait "$check_pid"
echo $? >"$O/check_bw.rc"
cat "$hw/sent_pkts" >"$O/rxe_sent_bw_after"
grep -H . "$hw"/* >"$O/hw_counters_bw_after.txt" 2>&1
rdma res show qp >"$O/rdma-res-show-qp-idle.txt" 2>&1
kill -CONT "$holder" 2>/dev/null
kill "$holder" 2>/dev/null
log "check around perftest: rc $(cat "$O/check_bw.rc"), perftest rc $(cat "$O/ib_write_bw.rc")"
mark done
log "done"
