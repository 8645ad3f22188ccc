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

# s NAME CMD...: run CMD, keep its output in $out/NAME.txt and log it with its exit status.
s() {
    name="$1"
    shift
    "$@" >"$out/$name.txt" 2>&1
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
