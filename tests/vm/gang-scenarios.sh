# The gang pre-flight's RDMA half on real kernels, run in both VMs of tests/vm/run-pair.sh
# (FG_ROLE=a or b, FG_HOST_NET=1: a third NIC, eth2, on a qemu user network whose 10.0.3.2
# is this host) by tests/vm/gang_vm.rs. Each VM runs one agent (`fabricgate run`, peers
# enabled, --peers-listen on its eth1 address) against the host's real kube-apiserver with its
# Node's pod-bound token (FG_KUBECONFIG_A / _B); the host runs `fabricgate admission-check`,
# reserves quota for Workloads on the two Nodes as Kueue does, and acknowledges steps with
# marker files host.NAME in the shared folder /tmp/fg-sync:
#   1. both agents validate their Nodes and advertise fabricgate.io/peers-endpoint; the
#      controller asks a FabricCheck of the ring a -> b -> a (link up: both pairs measured
#      over rxe0, the check Ready);
#   2. on host.cut, b takes eth0 (rxe0's netdev) down and marks b.cut; the host reserves a
#      second Workload at once (a -> b fails: Retry naming the pair);
#   3. on host.done both agents stop.
# Needs FG_BIN.
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
# shellcheck source=tests/vm/pair-lib.sh
. "$FG_VM_DIR/pair-lib.sh"
if [ "$ROLE" = a ]; then
    NODE="$FG_NODE_A" KCFG="$FG_KUBECONFIG_A"
else
    NODE="$FG_NODE_B" KCFG="$FG_KUBECONFIG_B"
fi
CFG=/tmp/gang.yaml
KEY=/tmp/peers.key

fg_pair_up
# eth2: this VM's own qemu user network; 10.0.3.2 is the host (the apiserver's certificate
# names it).
ip link set eth2 up && ip addr add 10.0.3.15/24 dev eth2 || fail "eth2"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add"
fg_wait_port ACTIVE 30 || fail "rxe0 not ACTIVE"
log "rxe0 ACTIVE"

echo "5f2a9c7e1b3d4f6a8c0e2b4d6f8a1c3e5b7d9f0a2c4e6b8d0f1a3c5e7b9d2f4a" >"$KEY"
cat "$FG_VM_DIR/rxe-requirements.yaml" >"$CFG"
cat >>"$CFG" <<EOF
peers:
  enabled: true
  listen: "0.0.0.0:9465"
  key_file: $KEY
  interval: 1h
  timeout: 20s
  bandwidth:
    message_size: 65536
    duration: 200ms
EOF
sed -i 's/selftest_timeout: 2s/selftest_timeout: 10s/' "$CFG"
# b judges its node once, at start (node.recover_after 1: one good probe validates it): no
# event-driven probes and no further interval, so that
# the cut below falls between its own checks (the window the gang pre-flight exists for: a
# node still validated whose path is broken) and the controller sees it validated.
INTERVAL=2s
if [ "$ROLE" = b ]; then
    INTERVAL=1h
    printf 'events:\n  enabled: false\nnode:\n  recover_after: 1\n' >>"$CFG"
fi

KUBECONFIG="$KCFG" RUST_LOG=info "$FG_BIN" run --config "$CFG" --node-name "$NODE" \
    --interval "$INTERVAL" --metrics-addr 127.0.0.1:9464 \
    --peers-listen "169.254.78.$ME:9465" >"$O/agent.log" 2>&1 &
agent=$!
mark started

if [ "$ROLE" = b ]; then
    wait_for host cut 900
    kill -0 "$agent" 2>/dev/null || fail "the agent exited: $(tail -5 "$O/agent.log")"
    ip link set eth0 down
    mark cut
fi
wait_for host done 900
kill -0 "$agent" 2>/dev/null || fail "the agent exited: $(tail -5 "$O/agent.log")"
kill -TERM "$agent"
wait "$agent"
echo $? >"$O/agent.rc"
ip link set eth0 up
exit 0
