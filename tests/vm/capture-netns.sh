# Run inside the Soft-RoCE VM by tests/vm/run.sh: what the kernel does with an RDMA device and
# network namespaces, in the shared mode (the default) and in the exclusive mode a DRA driver
# (DraNet) uses to hand an HCA to a pod. Every step's command, output and exit status goes to
# $FG_OUT/netns/steps.txt (and each step's output to its own file); the RDMA netlink device
# dumps from each side (scripts/capture_rdma_restrack.py) and the sysfs trees of both views
# (tests/vm/sysfs_tree.py) go next to it. tests/vm/netns_vm.rs asserts on them; docs/dra.md
# ("Exclusive RDMA network namespaces") quotes them.
#
#   tests/vm/run.sh -o /tmp/netns tests/vm/capture-netns.sh
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
fg_rxe_up || exit 1
out="$FG_OUT/netns"
mkdir -p "$out"
steps="$out/steps.txt"
: >"$steps"

# s NAME CMD...: run CMD, keep its output (stdout and stderr) in $out/NAME.txt and log it
# with its exit status.
s() { step_of merged "$@"; }

# sj NAME CMD...: as s, for a command whose standard output is a JSON document: only that is
# the step's output (what it says on stderr, such as check's progress line, goes to NAME.stderr).
sj() { step_of apart "$@"; }

step_of() {
    how="$1" name="$2"
    shift 2
    if [ "$how" = apart ]; then
        "$@" >"$out/$name.txt" 2>"$out/$name.stderr"
    else
        "$@" >"$out/$name.txt" 2>&1
    fi
    rc=$?
    {
        echo "### $name: $*"
        cat "$out/$name.txt"
        echo "### rc $rc"
    } >>"$steps"
    return 0
}

# views TAG: what the host namespace and the namespace pod0 (when it exists) show.
# `ip netns exec` mounts a fresh sysfs in a private mount namespace: that sysfs shows the
# classes of the namespace it was mounted in. `nsenter --net` keeps the host's sysfs mount.
views() {
    s "$1-host-sys" ls -la /sys/class/infiniband /sys/class/infiniband_verbs
    s "$1-host-dev" ls /dev/infiniband
    s "$1-host-rdma-dev" rdma dev show
    s "$1-host-rdma-link" rdma link show
    s "$1-host-ip-link" ip -br link show
    if [ -e /run/netns/pod0 ]; then
        s "$1-ns-sys" ip netns exec pod0 ls -la /sys/class/infiniband /sys/class/infiniband_verbs
        s "$1-ns-nsenter-sys" nsenter --net=/run/netns/pod0 ls /sys/class/infiniband
        s "$1-ns-rdma-dev" ip netns exec pod0 rdma dev show
        s "$1-ns-rdma-link" ip netns exec pod0 rdma link show
        s "$1-ns-ip-link" ip netns exec pod0 ip -br link show
    fi
}

# dumps TAG: the RDMA netlink device dumps, byte for byte, from each side, and the agent's
# own probe (`fabricgate check`) on each side.
dumps() {
    mkdir -p "$out/$1-host" "$out/$1-ns"
    s "$1-host-dump" python3 "$FG_CWD/scripts/capture_rdma_restrack.py" "$out/$1-host"
    s "$1-ns-dump" ip netns exec pod0 python3 "$FG_CWD/scripts/capture_rdma_restrack.py" "$out/$1-ns"
    if [ -n "${FG_BIN:-}" ]; then
        s "$1-host-check" "$FG_BIN" check --format json --config "$FG_REQ"
        s "$1-ns-check" ip netns exec pod0 "$FG_BIN" check --format json --config "$FG_REQ"
    fi
}

s mode-initial rdma system show
# Shared mode: one device, visible in every namespace.
s shared-netns-add ip netns add pod0
views shared
s shared-move rdma dev set rxe0 netns pod0
s shared-set-exclusive-with-netns rdma system set netns exclusive
s shared-netns-del ip netns del pod0
# The namespace is freed asynchronously (cleanup_net); retry for a few seconds.
i=0
while ! rdma system set netns exclusive 2>/dev/null && [ "$i" -lt 50 ]; do
    sleep 0.1
    i=$((i + 1))
done
echo "### exclusive-set retried $i times after the namespace was deleted" >>"$steps"
s exclusive-set rdma system set netns exclusive
s mode-exclusive rdma system show

# Exclusive mode: the device lives in exactly one namespace (here the host's); a namespace
# created now sees none of it. This is the view the host has of an HCA a DRA driver moved
# into a pod, and the pod's view of it is the host's view here.
s exclusive-netns-add ip netns add pod0
views excl
python3 "$FG_VM_DIR/sysfs_tree.py" /sys "$out/tree-host" >"$out/tree-host.log" 2>&1
ip netns exec pod0 python3 "$FG_VM_DIR/sysfs_tree.py" /sys "$out/tree-ns" >"$out/tree-ns.log" 2>&1
dumps excl
s excl-ns-ibv ip netns exec pod0 ibv_devices

# An HCA in a pod's namespace, seen by an agent in another one. rxe0 cannot be moved (below),
# so the roles are swapped, which is the same to the kernel: the "agent" (`fabricgate check`)
# runs in pod0, where no RDMA device is, and the "pod" whose namespace holds the HCA is a
# process in a kubepods-shaped cgroup of the host's namespace, where rxe0 lives. The agent
# finds the pod's process, enters its network namespace (setns from a thread of its own),
# asks RDMA netlink there for the devices and their ports, and reports them; then rxe0's port
# goes down (its netdev down) and the same look says so.
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || mountpoint -q /sys/fs/cgroup ||
    echo "### cannot mount cgroup2 at /sys/fs/cgroup" >>"$steps"
pod_uid=5d1e8f3a-2b4c-4d6e-8f0a-1c3e5a7b9d2f
ctr="/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod$(echo "$pod_uid" | tr - _).slice/cri-containerd-9b8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0.scope"
mkdir -p "$ctr"
# The pod's process holds a queue pair on rxe0 (an RC pingpong server waiting for its peer).
sh -c 'echo $$ >"$1/cgroup.procs" && exec ibv_rc_pingpong -d rxe0 -g 0' sh "$ctr" >"$out/hca-pod.log" 2>&1 &
hca_pod_pid=$!
i=0
until grep -qx "$hca_pod_pid" "$ctr/cgroup.procs" 2>/dev/null || [ "$i" -ge 100 ]; do
    sleep 0.1
    i=$((i + 1))
done
echo "### hca pod uid $pod_uid pid $hca_pod_pid" >>"$steps"
# The pods section lists the pod's sockets too (sock_diag): a real kernel loads tcp_diag on
# first use; this VM's modules are not in /lib/modules.
modprobe -d "$FG_KROOT" -S "$FG_KVER" tcp_diag 2>/dev/null ||
    echo "### cannot load tcp_diag" >>"$steps"
mkdir -p "$out/excl-pod-ports"
s excl-pod-ports-dump nsenter --net=/proc/$hca_pod_pid/ns/net python3 "$FG_CWD/scripts/capture_rdma_restrack.py" "$out/excl-pod-ports"
if [ -n "${FG_BIN:-}" ]; then
    sj excl-agent-in-ns-check ip netns exec pod0 "$FG_BIN" check --format json --config "$FG_REQ" --pods on --pods-window 1s
    # What of it needs CAP_NET_ADMIN (deploy/overlays/runtime-transport grants it): the same
    # looks with it taken away — the look into the pod's namespace, and from the host's
    # namespace the QP dump that attributes the pod's queue pair.
    s no-net-admin-capeff capsh --drop=cap_net_admin -- -c 'grep CapEff /proc/self/status'
    sj excl-agent-in-ns-check-no-net-admin ip netns exec pod0 capsh --drop=cap_net_admin -- -c "$FG_BIN check --format json --config $FG_REQ --pods on --pods-window 1s"
    sj excl-host-check-pods "$FG_BIN" check --format json --config "$FG_REQ" --pods on --pods-window 1s
    sj excl-host-check-pods-no-net-admin capsh --drop=cap_net_admin -- -c "$FG_BIN check --format json --config $FG_REQ --pods on --pods-window 1s"
    s excl-rdma-res-qp-no-net-admin capsh --drop=cap_net_admin -- -c 'rdma res show qp'
    s excl-hca-port-down ip link set eth0 down
    fg_wait_port DOWN 10 || true
    s excl-host-rdma-link-down rdma link show
    sj excl-agent-in-ns-check-down ip netns exec pod0 "$FG_BIN" check --format json --config "$FG_REQ" --pods on --pods-window 1s
    s excl-agent-in-ns-check-down-table ip netns exec pod0 "$FG_BIN" check --config "$FG_REQ" --pods on --pods-window 1s
    mkdir -p "$out/excl-pod-ports-down"
    s excl-pod-ports-dump-down python3 "$FG_CWD/scripts/capture_rdma_restrack.py" "$out/excl-pod-ports-down"
    s excl-hca-port-up ip link set eth0 up
    fg_wait_port ACTIVE 10 || true
fi
# rxe cannot cut a user off: its device stays until the process holding it is gone.
kill "$hca_pod_pid" 2>/dev/null
wait "$hca_pod_pid" 2>/dev/null
s excl-host-ibv ibv_devices
# Moving a device needs a driver that can cut its users off (disassociate_ucontext): mlx5
# can, rxe cannot.
s exclusive-move rdma dev set rxe0 netns pod0
s exclusive-move-host-rdma-dev rdma dev show
# The netdev under the device moves: rxe unregisters its device with it.
s netdev-move ip link set eth0 netns pod0
sleep 1
views netdev
s mode-end rdma system show
cat "$steps"
