# The Soft-RoCE scenarios, run inside the VM by tests/vm/softroce_vm.rs (through run.sh).
# Each step leaves NAME.json (the command's stdout) and NAME.rc in $FG_OUT, and timings in
# $FG_OUT/timings.env; the Rust test asserts on them. One boot runs them all.
# Needs FG_BIN (the fabricgate binary) and FG_REQ (tests/vm/rxe-requirements.yaml).
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
O="$FG_OUT"
: >"$O/timings.env"

# step NAME CMD...: run a fabricgate command, keep stdout and the exit status.
step() {
    name="$1"
    shift
    "$@" >"$O/$name.json" 2>"$O/$name.stderr"
    echo $? >"$O/$name.rc"
}
check() { step "$1" "$FG_BIN" check --format json --config "$FG_REQ"; }
is_ready() { grep -q '^  "ready": true' "$O/$1.json"; }

fg_rxe_up || { echo "rxe setup failed" >&2; dmesg | tail -20 >&2; exit 1; }

# 1. rxe0 up: verbs opened, port ACTIVE, RoCE v2 GID, eth0 mapped, ready.
check up
# 2. The data-path self-test alone; and with RLIMIT_MEMLOCK too low and no IPC_LOCK.
step selftest "$FG_BIN" selftest --format json --config "$FG_REQ"
(
    ulimit -l 1
    step selftest_memlock setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock \
        "$FG_BIN" selftest --format json --config "$FG_REQ"
    step check_memlock setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock \
        "$FG_BIN" check --format json --config "$FG_REQ"
)

# P. `fabricgate preflight` as a worker pod's init container runs it: rxe0 given and a required
#    path mounted; /dev/infiniband not injected; memlock 64 KiB without IPC_LOCK; a required
#    path missing. Each leaves NAME.stdout/.stderr/.rc, NAME.termlog (the termination log),
#    NAME.nccl/ (the emptyDir) and NAME_ms (wall time, from before exec to exit) in timings.
now_ms() { date +%s%3N; }
pf() {
    name="$1"
    shift
    mkdir -p "$O/$name.nccl"
    t0=$(now_ms)
    "$@" preflight --nccl-dir "$O/$name.nccl" --termination-log "$O/$name.termlog" \
        >"$O/$name.stdout" 2>"$O/$name.stderr"
    echo $? >"$O/$name.rc"
    timing "${name}_ms" $(($(now_ms) - t0))
}
PF_REQ="$(cat "$FG_REQ")
mounts:
  - path: /tmp
    fstype: tmpfs"
(
    ulimit -l unlimited
    FABRICGATE_REQUIREMENTS="$PF_REQ" pf preflight_ok "$FG_BIN"
)
mount -t tmpfs tmpfs /dev/infiniband
FABRICGATE_REQUIREMENTS="$PF_REQ" pf preflight_hidden "$FG_BIN"
umount /dev/infiniband
(
    ulimit -l 64
    FABRICGATE_REQUIREMENTS="$PF_REQ" pf preflight_memlock \
        setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock "$FG_BIN"
)
(
    ulimit -l unlimited
    FABRICGATE_REQUIREMENTS="$PF_REQ
  - path: /data/missing" pf preflight_no_path "$FG_BIN"
)

# 3. eth0 down: time from the command to the first check that says not ready.
t0=$(fg_now_ms)
ip link set eth0 down
(fg_wait_port DOWN 10 && timing down_to_sysfs_ms $(($(fg_now_ms) - t0))) &
sysfs_wait=$!
tries=0
while :; do
    tries=$((tries + 1))
    check down
    is_ready down || break
    [ "$tries" -ge 20 ] && break
    sleep 0.2
done
timing down_to_not_ready_ms $(($(fg_now_ms) - t0))
timing down_checks "$tries"
wait "$sysfs_wait"
check_ms=$(fg_now_ms)
check down_again
timing check_ms $(($(fg_now_ms) - check_ms))
step selftest_down "$FG_BIN" selftest --format json --config "$FG_REQ"

# 4. eth0 back up: ready again.
t0=$(fg_now_ms)
ip link set eth0 up
fg_wait_port ACTIVE 20
timing up_to_active_ms $(($(fg_now_ms) - t0))
tries=0
while :; do
    tries=$((tries + 1))
    check up_again
    is_ready up_again && break
    [ "$tries" -ge 20 ] && break
    sleep 0.2
done
timing up_to_ready_ms $(($(fg_now_ms) - t0))

# 5. sysfs and verbs disagree: /dev/infiniband hidden as when a device plugin fails.
mount -t tmpfs tmpfs /dev/infiniband
check hidden
umount /dev/infiniband

# 6. The daemon against the real kube-apiserver on the host (FG_KUBECONFIG, server
#    https://10.0.3.2:PORT over eth1): the host test watches the Node's taint and acknowledges
#    each phase with $FG_OUT/host.NAME; we take eth0 down and up between them.
daemon=""
if [ -n "${FG_KUBECONFIG:-}" ]; then
    KUBECONFIG="$FG_KUBECONFIG" RUST_LOG=info "$FG_BIN" run --config "$FG_REQ" \
        --node-name "${FG_NODE:-fabricgate-vm}" --interval 1s \
        --metrics-addr 127.0.0.1:9464 >"$O/daemon.log" 2>&1 &
    daemon=$!
    echo "$daemon" >"$O/daemon.started"
    if fg_wait_host ready 120; then
        ip link set eth0 down
        : >"$O/daemon.down"
        if fg_wait_host tainted 60; then
            ip link set eth0 up
            : >"$O/daemon.up"
            fg_wait_host untainted 90
        fi
    fi
fi

# 6b. The agent without access to the device nodes (its /dev/infiniband hidden, as in a
#     container the device cgroup or plugin gives nothing): the Node says AgentError, not a
#     hardware reason, and is tainted (node.on_agent_error: taint). Then the normal agent is
#     back and validates the node again.
if [ -n "$daemon" ] && [ -e "$O/host.untainted" ]; then
    kill -TERM "$daemon"
    wait "$daemon"
    KUBECONFIG="$FG_KUBECONFIG" RUST_LOG=info unshare -m --propagation private sh -c \
        'mount -t tmpfs tmpfs /dev/infiniband && exec "$@"' hidden-agent \
        "$FG_BIN" run --config "$FG_REQ" --node-name "${FG_NODE:-fabricgate-vm}" \
        --interval 1s --metrics-addr 127.0.0.1:9464 >"$O/daemon_hidden.log" 2>&1 &
    hidden=$!
    : >"$O/daemon.hidden"
    fg_wait_host agent_error 60
    kill -TERM "$hidden"
    wait "$hidden"
    KUBECONFIG="$FG_KUBECONFIG" RUST_LOG=info "$FG_BIN" run --config "$FG_REQ" \
        --node-name "${FG_NODE:-fabricgate-vm}" --interval 1s \
        --metrics-addr 127.0.0.1:9464 >"$O/daemon_again.log" 2>&1 &
    daemon=$!
    : >"$O/daemon.restarted"
    fg_wait_host recovered 90
fi

# 7. rxe0 deleted while checks (and the daemon) keep running: each check must finish (ready
#    or not), none may crash, and the daemon taints the Node again and keeps running.
i=0
: >"$O/vanish.rcs"
(
    while [ "$i" -lt 6 ]; do
        "$FG_BIN" check --format json --config "$FG_REQ" >"$O/vanish_$i.json" 2>>"$O/vanish.stderr"
        echo $? >>"$O/vanish.rcs"
        i=$((i + 1))
    done
) &
loop=$!
sleep 2
rdma link delete rxe0
echo deleted >"$O/vanish.deleted"
wait "$loop"
check gone
if [ -n "$daemon" ]; then
    fg_wait_host tainted_again 60
    if kill -0 "$daemon" 2>/dev/null; then
        echo alive >"$O/daemon.alive_after_delete"
        kill -TERM "$daemon"
    fi
    wait "$daemon"
    echo $? >"$O/daemon.rc"
fi
exit 0
