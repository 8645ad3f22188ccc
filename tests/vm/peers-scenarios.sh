# The inter-node peer scenarios, run in both VMs of tests/vm/run-pair.sh (FG_ROLE=a or b) by
# tests/vm/peers_vm.rs. One boot of the pair runs them all; the guests order their steps with
# marker files in the shared folder /tmp/fg-sync (ROLE.NAME).
#   1. rxe0 over eth0 in both; an agent in each (`fabricgate run --dry-run`, peers enabled,
#      --peers = the other VM); a scrape of /metrics every second into $FG_OUT/scrapes/;
#      wait until each reports RTT and bandwidth for the other; `fabricgate ping` each way.
#   1b. a stranger in a (its own eth1 address, no key) dribbles bytes to a's responder and
#      holds idle connections for 20 s while b measures a (tests/vm/peer_attack.py).
#   2. b takes eth0 down; a keeps scraping for three more rounds; `fabricgate ping` again
#      both ways (a: the peer is unreachable, b: no usable local port).
#   3. agents stopped, eth0 up again, perftest's ib_write_lat and ib_write_bw between the two.
# The wire under rxe0 is checked on its own (ICMP over eth0, tests/vm/wire_echo.py) before and
# after the attack and before perftest ($FG_OUT/wire_*.json), and the kernel's log is kept
# ($FG_OUT/dmesg.log), so that a failed run tells a dead emulated wire from a failure of RDMA.
# Needs FG_BIN (the fabricgate binary).
# shellcheck shell=sh
set -u
. "$FG_VM_DIR/guest-lib.sh"
# shellcheck source=tests/vm/pair-lib.sh
. "$FG_VM_DIR/pair-lib.sh"
PEER_IP="169.254.78.$OTHER"
CFG=/tmp/peers.yaml
# The pool's side-channel key (the DaemonSet's fabricgate-peers Secret): the same in both VMs.
KEY=/tmp/peers.key
: >"$O/timings.env"
# wire NAME SECONDS: ICMP echo over eth0 to the other VM's eth0 address into $O/wire_NAME.json.
wire() {
    python3 "$FG_VM_DIR/wire_echo.py" eth0 "169.254.77.$OTHER" "$2" >"$O/wire_$1.json" 2>&1 ||
        log "wire $1: eth0 did not answer: $(cat "$O/wire_$1.json")"
}

fg_pair_up
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add"
fg_wait_port ACTIVE 30 || fail "rxe0 not ACTIVE"
fg_net_watch

fg_wait_roce_v2_gid
log "rxe0 ACTIVE, GID index $GIDX"
mark up
wait_for "$PEER_ROLE" up 240

echo "5f2a9c7e1b3d4f6a8c0e2b4d6f8a1c3e5b7d9f0a2c4e6b8d0f1a3c5e7b9d2f4a" >"$KEY"
cat >"$CFG" <<EOF
rdma:
  devices: "rxe*"
  min_active_ports: 1
  link_layer: Ethernet
  require_roce_v2: true
  selftest: on-start
  selftest_timeout: 10s
peers:
  enabled: true
  listen: "0.0.0.0:9465"
  key_file: $KEY
  per_round: 3
  interval: 3s
  timeout: 20s
  rtt_messages: 16
  rtt_message_size: 64
  keep_rounds: 5
  bandwidth:
    enabled: true
    message_size: 65536
    duration: 200ms
EOF

# --- 1. agents measure each other ------------------------------------------------------
RUST_LOG=info,fabricgate::peers=debug "$FG_BIN" run --dry-run --config "$CFG" \
    --node-name "vm-$ROLE" --interval 2s --metrics-addr 127.0.0.1:9464 \
    --peers "$PEER_IP" --peers-listen "169.254.78.$ME:9465" >"$O/agent.log" 2>&1 &
agent=$!
mkdir -p "$O/scrapes"
(
    i=0
    while [ ! -e "$S/$ROLE.stop_scrape" ]; do
        t=$(date +%s%3N)
        if curl -s --max-time 5 -o "$O/scrapes/$i.prom.tmp" http://127.0.0.1:9464/metrics; then
            mv "$O/scrapes/$i.prom.tmp" "$O/scrapes/$i.prom"
            echo "$i $t" >>"$O/scrapes/index"
            i=$((i + 1))
        fi
        sleep 1
    done
) &
scraper=$!
t0=$(fg_now_ms)
latest() { ls "$O/scrapes/" | grep -c '\.prom$'; }
measured() {
    n=$(($(latest) - 1))
    [ "$n" -ge 0 ] || return 1
    f="$O/scrapes/$n.prom"
    grep -q "^fabricgate_peer_rtt_seconds{.*peer=\"$PEER_IP\".*stat=\"median\"}" "$f" &&
        grep -q "^fabricgate_peer_bandwidth_bytes_per_second{.*peer=\"$PEER_IP\"}" "$f"
}
i=0
until measured; do
    i=$((i + 1))
    [ "$i" -ge 300 ] && fail "no RTT and bandwidth for $PEER_IP in /metrics within 300 s"
    kill -0 "$agent" 2>/dev/null || fail "the agent exited: $(tail -5 "$O/agent.log")"
    sleep 1
done
timing start_to_measured_ms $(($(fg_now_ms) - t0))
mark measured
wait_for "$PEER_ROLE" measured 300

# fabricgate ping, table and JSON; the peer's agent answers.
"$FG_BIN" ping "$PEER_IP" --config "$CFG" --bandwidth --node-name "vm-$ROLE" \
    >"$O/ping.txt" 2>"$O/ping.stderr"
echo $? >"$O/ping_table.rc"
t=$(fg_now_ms)
"$FG_BIN" ping "$PEER_IP" --config "$CFG" --bandwidth --node-name "vm-$ROLE" --format json \
    >"$O/ping.json" 2>>"$O/ping.stderr"
echo $? >"$O/ping.rc"
timing ping_ms $(($(fg_now_ms) - t))
# CPU of one `fabricgate ping` process (user + system, clock ticks of 1/100 s).
/usr/bin/time -f "%U %S %e" -o "$O/ping.time" "$FG_BIN" ping "$PEER_IP" --config "$CFG" \
    --node-name "vm-$ROLE" --format json >/dev/null 2>&1 || true
mark pinged
wait_for "$PEER_ROLE" pinged 300

# --- 1b. a stranger attacks a's side channel while b measures a ------------------------
# From a's own eth1 address (another source than b's), without the pool's key: 4 dribblers
# (a byte every 2 s) and 64 idle connections held, for 20 s (tests/vm/peer_attack.py). b's
# rounds must go on, a's RTT series in b must stay, b's error counters for a must not move.
ATTACK_S=20
if [ "$ROLE" = a ]; then
    wait_for b ready_for_attack 120
    wire before_attack 10
    curl -s --max-time 60 -o "$O/attack_start.prom" http://127.0.0.1:9464/metrics ||
        log "no scrape at the attack's start"
    date +%s%3N >"$S/attack_start_ms"
    mark attack_start
    python3 "$FG_VM_DIR/peer_attack.py" "169.254.78.$ME" 9465 "$ATTACK_S" \
        >"$O/attack.json" 2>"$O/attack.stderr"
    echo $? >"$O/attack.rc"
    date +%s%3N >"$S/attack_end_ms"
    curl -s --max-time 60 -o "$O/attack_end.prom" http://127.0.0.1:9464/metrics ||
        log "no scrape at the attack's end"
    mark attack_done
    wire after_attack 10
    wait_for b attack_observed 120
else
    wire before_attack 10
    mark ready_for_attack
    wait_for a attack_start 120
    curl -s --max-time 60 -o "$O/attack_start.prom" http://127.0.0.1:9464/metrics ||
        log "no scrape at the attack's start"
    wait_for a attack_done 120
    curl -s --max-time 60 -o "$O/attack_end.prom" http://127.0.0.1:9464/metrics ||
        log "no scrape at the attack's end"
    wire after_attack 10
    mark attack_observed
fi

# --- 2. b cuts its RDMA link ---------------------------------------------------------
rounds_now() {
    n=$(($(latest) - 1))
    awk '/^fabricgate_peer_rounds_total /{print $2}' "$O/scrapes/$n.prom" 2>/dev/null
}
if [ "$ROLE" = b ]; then
    wait_for a ready_for_cut 120
    date +%s%3N >"$S/cut_at_ms"
    ip link set eth0 down
    mark cut
    fg_wait_port DOWN 20 || log "port did not report DOWN"
    # Our own ping has no usable port now.
    sleep 3
    "$FG_BIN" ping "$PEER_IP" --config "$CFG" --node-name "vm-$ROLE" --format json \
        >"$O/ping_cut.json" 2>"$O/ping_cut.stderr"
    echo $? >"$O/ping_cut.rc"
    wait_for a observed_cut 300
else
    mark ready_for_cut
    wait_for b cut 120
    # The counters at the cut, fresh (the scraper may be mid-sleep).
    curl -s --max-time 60 -o "$O/cut.prom" http://127.0.0.1:9464/metrics || log "no scrape at the cut"
    r0=$(awk '/^fabricgate_peer_rounds_total /{print $2}' "$O/cut.prom" 2>/dev/null)
    echo "rounds_at_cut=$r0" >>"$O/timings.env"
    i=0
    while :; do
        r=$(rounds_now)
        [ -n "$r" ] && [ -n "$r0" ] && [ "$r" -ge $((r0 + 3)) ] && break
        i=$((i + 1))
        [ "$i" -ge 240 ] && { log "rounds did not advance: $r0 -> $r"; break; }
        sleep 1
    done
    "$FG_BIN" ping "$PEER_IP" --config "$CFG" --node-name "vm-$ROLE" --format json \
        >"$O/ping_cut.json" 2>"$O/ping_cut.stderr"
    echo $? >"$O/ping_cut.rc"
    mark observed_cut
fi
: >"$S/$ROLE.stop_scrape"
wait "$scraper"
kill -TERM "$agent"
wait "$agent"
echo $? >"$O/agent.rc"
mark agent_stopped
wait_for "$PEER_ROLE" agent_stopped 120

# --- 3. perftest between the two, for comparison -------------------------------------
if [ "$ROLE" = b ]; then
    ip link set eth0 up
    fg_wait_port ACTIVE 30 || fail "rxe0 not ACTIVE again"
fi
fg_wait_roce_v2_gid
mark up_again
wait_for "$PEER_ROLE" up_again 120
# perftest's QPs resolve the peer's MAC in their move to RTR, with 1 s for ARP; b's eth0 was
# down, its neighbour entries are gone: resolve them first (both ways: a's answers go to b).
wire before_perftest 30
log "GID index $GIDX for perftest"
# bounded SECONDS OUT CMD...: CMD, its output line-buffered into OUT; when it still runs after
# SECONDS, the QPs' states and rxe0's counters are added to OUT and it is killed (status 124).
bounded() {
    secs="$1" out="$2"
    shift 2
    stdbuf -oL -eL "$@" >"$out" 2>&1 &
    pid=$!
    i=0
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$i" -ge $((secs * 5)) ]; then
            {
                echo "--- still running after $secs s: rdma res show qp"
                rdma res show qp
                echo "--- rdma statistic show link rxe0/1"
                rdma statistic show link rxe0/1
            } >>"$out" 2>&1
            kill "$pid"
            wait "$pid"
            return 124
        fi
        sleep 0.2
        i=$((i + 1))
    done
    wait "$pid"
}
# perftest_pair NAME ARGS: perftest's NAME between the two (a the server, b the client over
# eth1) into $O/NAME.txt and $O/NAME.rc, each try's output in $O/NAME.tryN.txt. Once (CI, a
# loaded machine) the client sat silent until its timeout with nothing to say where: a try
# that hangs now leaves what it printed and the QPs' states, and a failed first try is
# followed by a second, which the test reports. The server is marked listening once its port
# (18515) is, not after a fixed sleep.
perftest_pair() {
    name="$1"
    for try in 1 2; do
        out="$O/$name.try$try.txt"
        if [ "$ROLE" = a ]; then
            # shellcheck disable=SC2086
            bounded 90 "$out" "$name" $2 &
            srv=$!
            i=0
            while [ "$i" -lt 300 ] && ! ss -Hltn "sport = :18515" | grep -q .; do
                sleep 0.1
                i=$((i + 1))
            done
            mark "${name}_listening$try"
            wait "$srv"
            rc=$?
        else
            wait_for a "${name}_listening$try" 240
            # shellcheck disable=SC2086
            bounded 90 "$out" "$name" $2 "169.254.78.$OTHER"
            rc=$?
        fi
        echo "$rc" >"$S/$ROLE.${name}_rc$try"
        mark "${name}_done$try"
        wait_for "$PEER_ROLE" "${name}_done$try" 240
        a_rc="$(cat "$S/a.${name}_rc$try")" b_rc="$(cat "$S/b.${name}_rc$try")"
        [ "$a_rc" = 0 ] && [ "$b_rc" = 0 ] && break
        log "$name try $try failed: a rc $a_rc, b rc $b_rc"
    done
    cp "$out" "$O/$name.txt"
    echo "$rc" >"$O/$name.rc"
}
# -F: no CPU-frequency warning failure (a VM has no cpufreq).
perftest_pair ib_write_lat "-d rxe0 -i 1 -x $GIDX -s 64 -n 200 -F"
perftest_pair ib_write_bw "-d rxe0 -i 1 -x $GIDX -s 65536 -n 400 -F"
mark done
wait_for "$PEER_ROLE" done 300
dmesg >"$O/dmesg.log" 2>&1
exit 0
