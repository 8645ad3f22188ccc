# Run inside the Soft-RoCE VM by tests/vm/dra_netns_vm.rs (through run.sh): the agent daemon
# against the real kube-apiserver on the host, in RDMA netns mode exclusive, where the one HCA
# (rxe0) is in the network namespace of a pod that a ResourceClaim gave it to, not in the
# agent's. rxe cannot be moved (docs/dra.md), so the roles are swapped, which is the same to
# the kernel: the pod's process (a kubepods cgroup named after the real Pod's UID, FG_POD_UID,
# holding a queue pair on rxe0) stays in the namespace where rxe0 lives, and the agent runs in
# a namespace of its own (`agent`, with eth1, the management NIC to the host, moved into it;
# its sysfs mounted there, so it sees no RDMA device). The agent reads the claim from the
# API, finds the pod's process, looks into its namespace over RDMA netlink and judges the HCA
# there: in use and up (the Node validated on 0 of 0 ports), then its port down (eth0 down:
# a DeviceTaintRule for its DRA device, the Node still validated), then up again (the rule
# removed). The host acknowledges each phase with $FG_OUT/host.NAME.
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
O="$FG_OUT"
fail() {
    echo "dra-netns-scenarios: $*" >&2
    : >"$O/guest.failed"
    exit 1
}
fg_rxe_up || fail "rxe setup failed"
# Exclusive mode can be set only while no other network namespace exists.
rdma system set netns exclusive || fail "rdma system set netns exclusive"
rdma system show >"$O/rdma-system.txt" 2>&1
modprobe -d "$FG_KROOT" -S "$FG_KVER" tcp_diag 2>/dev/null || true

# The pod: its process joins the container's cgroup (systemd driver naming), then holds an RC
# queue pair on rxe0 (a pingpong server waiting for its peer).
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || mountpoint -q /sys/fs/cgroup ||
    fail "cannot mount cgroup2 at /sys/fs/cgroup"
uid_=$(echo "$FG_POD_UID" | tr - _)
ctr="/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod$uid_.slice/cri-containerd-0d1c2b3a49586f7e0d1c2b3a49586f7e0d1c2b3a49586f7e0d1c2b3a49586f7e.scope"
mkdir -p "$ctr" || fail "cannot create the pod's cgroup"
sh -c 'echo $$ >"$1/cgroup.procs" && exec ibv_rc_pingpong -d rxe0 -g 0' sh "$ctr" \
    >"$O/pod.log" 2>&1 &
pod_pid=$!
i=0
until rdma res show qp | grep -q "pid $pod_pid "; do
    [ "$i" -ge 300 ] && fail "the pod's process $pod_pid holds no QP within 30 s"
    sleep 0.1
    i=$((i + 1))
done
echo "$pod_pid" >"$O/pod.pid"

# The agent's namespace: no RDMA device (exclusive mode), eth1 to reach the host.
ip netns add agent || fail "ip netns add agent"
ip link set eth1 netns agent || fail "cannot move eth1 into the agent's namespace"
ip -n agent link set lo up
ip -n agent addr add 10.0.3.15/24 dev eth1
ip -n agent link set eth1 up
ip netns exec agent ls /sys/class/infiniband >"$O/agent-class-infiniband.txt" 2>&1

# The DRA driver's kubelet plugin registration socket, alive for the agent's check.
mkdir -p /tmp/plugins_registry
python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(8)
while True:
    c, _ = s.accept()
    c.close()
' /tmp/plugins_registry/dra.net-reg.sock >"$O/plugin.log" 2>&1 &
plugin=$!

cat >/tmp/dra-netns.yaml <<YAML
rdma:
  devices: "rxe*"
  min_active_ports: 1
  link_layer: Ethernet
node:
  recover_after: 2
kubernetes:
  dra:
    drivers: [{name: dra.net}]
    registry_dir: /tmp/plugins_registry
    slice_grace: 3s
runtime:
  enabled: true
  window: 5s
YAML

KUBECONFIG="$FG_KUBECONFIG" RUST_LOG=info,fabricgate=debug ip netns exec agent "$FG_BIN" run \
    --config /tmp/dra-netns.yaml --node-name "$FG_NODE" --interval 1s \
    --metrics-addr 127.0.0.1:9464 >"$O/daemon.log" 2>&1 &
daemon=$!
: >"$O/agent.started"
rc=0
if fg_wait_host ready 180; then
    ip netns exec agent curl -fsS http://127.0.0.1:9464/metrics >"$O/metrics-ready.txt" 2>&1
    ip link set eth0 down
    fg_wait_port DOWN 10 || true
    rdma link show >"$O/rdma-link-down.txt" 2>&1
    : >"$O/port.down"
    if fg_wait_host ruled 60; then
        ip link set eth0 up
        fg_wait_port ACTIVE 10 || true
        : >"$O/port.up"
        fg_wait_host cleared 60 || rc=1
    else
        rc=1
    fi
else
    rc=1
fi
kill "$daemon" "$plugin" "$pod_pid" 2>/dev/null
wait "$daemon" 2>/dev/null
exit "$rc"
