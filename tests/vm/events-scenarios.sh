# Event-driven detection in the Soft-RoCE VM, run inside it by tests/vm/events_vm.rs (through
# run.sh): the agent runs with --interval 30s and --dry-run, and every time eth0 (rxe0's
# netdev) is set down (linkflip.py: the ioctl `ip link set eth0 down` makes, timed) the
# dry-run log of the taint must follow long before the next interval.
#
# Leaves in $FG_OUT: daemon.log (RUST_LOG=info,fabricgate::agent::wakeup=debug,fabricgate::observe::events=debug), metrics.txt (the
# agent's /metrics at the end), timings.env (microseconds unless named _ms) and daemon.rc.
# FG_FLIPS (default 10) sets how many down/up flips are timed.
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
O="$FG_OUT"
: >"$O/timings.env"
now_ns() { date +%s%N; }
# flip STATE: eth0 up or down by one ioctl; sets t0 to the wall clock right before it and
# flip_us to how long the call took (see linkflip.py).
flip() {
    out=$(python3 "$FG_VM_DIR/linkflip.py" eth0 "$1") || return 1
    # shellcheck disable=SC2086
    set -- $out
    t0=$1
    flip_us=$((($2 - $1) / 1000))
}

fg_rxe_up || { echo "rxe setup failed" >&2; dmesg | tail -20 >&2; exit 1; }

FLIPS="${FG_FLIPS:-10}"
LOG="$O/daemon.log"
cfg="$O/events.yaml"
# recover_after 1: a flip back up is one good probe, so each flip is short.
{ cat "$FG_REQ"; printf 'node:\n  recover_after: 1\n'; } >"$cfg"

RUST_LOG=info,fabricgate::agent::wakeup=debug,fabricgate::observe::events=debug "$FG_BIN" run --dry-run --config "$cfg" \
    --node-name fabricgate-vm --interval 30s --metrics-addr 127.0.0.1:9464 >"$LOG" 2>&1 &
daemon=$!

TAINT='would set taint fabricgate.io/unvalidated'
UNTAINT='would set taint none'

# size: the log's length now (a mark; only lines after it count).
size() { wc -c <"$LOG"; }

# after MARK PATTERN SECONDS: the timestamp (ns since the epoch) of the first log line after
# byte MARK that contains PATTERN and is not older than $t0 (a line written after the mark
# may carry an earlier time), waiting up to SECONDS for it. Text log lines start with an
# RFC 3339 timestamp.
after() {
    i=0
    while [ "$i" -lt $(($3 * 100)) ]; do
        for stamp in $(tail -c +$(($1 + 1)) "$LOG" | grep -F -- "$2" | cut -d' ' -f1); do
            ns=$(date -d "$stamp" +%s%N)
            if [ "$ns" -ge "${t0:-0}" ]; then
                echo "$ns"
                return 0
            fi
        done
        sleep 0.01
        i=$((i + 1))
    done
    return 1
}

fail() {
    echo "$1" >&2
    kill -TERM "$daemon" 2>/dev/null
    wait "$daemon"
    exit 1
}

after 0 "$UNTAINT" 120 >/dev/null || fail "the agent never validated the node"
sleep 1

i=1
while [ "$i" -le "$FLIPS" ]; do
    mark=$(size)
    flip down || fail "flip $i: cannot set eth0 down"
    timing "down_ioctl_us_$i" "$flip_us"
    t=$(after "$mark" "$TAINT" 10) || fail "flip $i: no taint in the log within 10 s of eth0 down"
    timing "down_to_taint_us_$i" $(((t - t0) / 1000))
    if t=$(after "$mark" "probe triggered by kernel events" 2); then
        timing "down_to_probe_us_$i" $(((t - t0) / 1000))
    fi
    if t=$(after "$mark" "node not ready" 2); then
        timing "down_to_verdict_us_$i" $(((t - t0) / 1000))
    fi
    if t=$(after "$mark" "IBV_EVENT_PORT_ERR" 2); then
        timing "down_to_port_err_us_$i" $(((t - t0) / 1000))
    fi
    if t=$(after "$mark" "link eth0 (ifindex" 2); then
        timing "down_to_netlink_us_$i" $(((t - t0) / 1000))
    fi
    sleep 1
    mark=$(size)
    flip up || fail "flip $i: cannot set eth0 up"
    t=$(after "$mark" "$UNTAINT" 20) || fail "flip $i: no untaint in the log within 20 s of eth0 up"
    timing "up_to_untaint_us_$i" $(((t - t0) / 1000))
    if t=$(after "$mark" "IBV_EVENT_PORT_ACTIVE" 2); then
        timing "up_to_port_active_us_$i" $(((t - t0) / 1000))
    fi
    sleep 1
    i=$((i + 1))
done

# The held verbs context must not hold up the removal of its device: rdma link delete
# completes, the uevent taints the node, and rdma link add brings it back (uevent: the
# contexts are re-opened).
mark=$(size)
t0=$(now_ns)
timeout 20 rdma link delete rxe0
echo $? >"$O/delete.rc"
timing delete_ms $((($(now_ns) - t0) / 1000000))
if t=$(after "$mark" "$TAINT" 10); then
    timing delete_to_taint_us $(((t - t0) / 1000))
fi
sleep 1
mark=$(size)
t0=$(now_ns)
rdma link add rxe0 type rxe netdev eth0
if t=$(after "$mark" "$UNTAINT" 20); then
    timing add_to_untaint_us $(((t - t0) / 1000))
fi
after "$mark" "event source listening" 5 >/dev/null && echo relistened >"$O/verbs.relistened"

curl -s http://127.0.0.1:9464/metrics >"$O/metrics.txt"
kill -TERM "$daemon"
wait "$daemon"
echo $? >"$O/daemon.rc"
exit 0
