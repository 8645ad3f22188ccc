# Run inside the Soft-RoCE VM by tests/vm/run.sh: capture the RDMA resource tracking dump
# (scripts/capture_rdma_restrack.py) while two ibv_rc_pingpong and two ibv_ud_pingpong hold
# QPs, with the RC server moved into a kubepods-shaped cgroup (v2, systemd driver); the
# replies, `rdma res show qp` (text and JSON) and each process's /proc/PID/cgroup go to
# $FG_OUT/capture, for probes/tests/fixtures/restrack/.
#
#   tests/vm/run.sh -o /tmp/restrack tests/vm/capture-restrack.sh
# shellcheck shell=sh
set -eu
. "$FG_VM_DIR/guest-lib.sh"
fg_rxe_up
out="$FG_OUT/capture"
mkdir -p "$out"
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || true
pod=/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice
pod="$pod/kubepods-besteffort-pod5f1d3c2e_8a4b_4f6e_9c1d_2b3a4c5d6e7f.slice"
ctr="$pod/cri-containerd-3b9e1f7a2c4d6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f9011223344556677a.scope"
mkdir -p "$ctr"

# fg_wait_qps PATTERN COUNT: wait (up to 60 s) until `rdma res show qp` has COUNT lines
# matching PATTERN (the emulated guest needs seconds to set a QP up, many more while the host's
# two cores also run the node and cluster suites beside it).
fg_wait_qps() {
    i=0
    while [ "$(rdma res show qp | grep -c "$1")" -lt "$2" ]; do
        [ "$i" -ge 600 ] && { echo "no $2 QPs matching '$1':" >&2; rdma res show qp >&2; return 1; }
        sleep 0.1
        i=$((i + 1))
    done
}

ibv_rc_pingpong -d rxe0 -g 1 -n 200000 >"$out/rc-server.log" 2>&1 &
rc_server=$!
echo "$rc_server" >"$ctr/cgroup.procs"
fg_wait_qps "type RC" 1
sleep 1
ibv_rc_pingpong -d rxe0 -g 1 -n 200000 10.0.2.15 >"$out/rc-client.log" 2>&1 &
rc_client=$!
fg_wait_qps "type RC state RTS" 2
ibv_ud_pingpong -d rxe0 -g 1 -n 200000 -p 18516 >"$out/ud-server.log" 2>&1 &
ud_server=$!
fg_wait_qps "type UD" 1
sleep 1
ibv_ud_pingpong -d rxe0 -g 1 -n 200000 -p 18516 10.0.2.15 >"$out/ud-client.log" 2>&1 &
ud_client=$!
fg_wait_qps "type UD state RTS" 2

python3 "$FG_CWD/scripts/capture_rdma_restrack.py" "$out"
rdma res show qp >"$out/rdma-res-show-qp.txt"
rdma -j res show qp >"$out/rdma-res-show-qp.json"
for p in $(sed -n 's/.* pid \([0-9]*\) .*/\1/p' "$out/rdma-res-show-qp.txt"); do
    cp "/proc/$p/cgroup" "$out/cgroup-$p" || true
done
echo "rc server $rc_server, rc client $rc_client, ud server $ud_server, ud client $ud_client" \
    >"$out/pids.txt"
kill $rc_server $rc_client $ud_server $ud_client 2>/dev/null || true
cat "$out/rdma-res-show-qp.txt" "$out/pids.txt"
