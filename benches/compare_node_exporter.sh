#!/usr/bin/env bash
# Side-by-side scrape latency: Debian's prometheus-node-exporter (only its infiniband
# collector, --path.sysfs at the fixture tree) against fabricgate over the same tree,
# tests/fixtures/bench-12x2 (12 RDMA devices / 24 ports).
#
#   benches/compare_node_exporter.sh [SCRAPES] [NODE_DIR]   (defaults: 200, bench-12x2)
#
# Then CPU per minute at equal freshness: fabricgate probing every FG_INTERVAL (default 10s),
# both exporters scraped every SCRAPE_EVERY seconds (default 15) for CPU_SECONDS (default 120;
# 0 skips it). CPU is each exporter's own cgroup's cpuacct.usage (cgroup v1) or cpu.stat
# usage_usec (v2): nanoseconds/microseconds of utime+stime of every thread, short-lived ones
# included. Where no cgroup can be made (not root), utime+stime from /proc/PID/stat (10 ms
# ticks, so use a long CPU_SECONDS).
#
# Needs: prometheus-node-exporter, curl (apt-get install -y prometheus-node-exporter curl).
# fabricgate is served by `fabricgate run --dry-run` when that subcommand works, else by the
# metrics_fixture example (same registry and HTTP server).
set -euo pipefail

N="${1:-200}"
cd "$(dirname "$0")/.."
NODE="$(realpath "${2:-tests/fixtures/bench-12x2}")"
command -v prometheus-node-exporter >/dev/null || { echo "install prometheus-node-exporter" >&2; exit 2; }
command -v curl >/dev/null || { echo "install curl" >&2; exit 2; }

cargo build --release --quiet --bin fabricgate --example metrics_fixture
BIN=target/release/fabricgate
HELPER=target/release/examples/metrics_fixture

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((20000 + RANDOM % 20000))
}

NE_PORT="$(free_port)"
FG_PORT="$(free_port)"

prometheus-node-exporter \
  --path.sysfs="$NODE/sys" --path.procfs="$NODE/proc" \
  --collector.disable-defaults --collector.infiniband \
  --web.disable-exporter-metrics \
  --web.listen-address="127.0.0.1:$NE_PORT" --log.level=warn &
PIDS+=("$!")

PROBE_RUN="$("$BIN" run --dry-run --verbs off --sysfs-root /nonexistent --proc-root /nonexistent 2>&1 || true)"
if [[ "$PROBE_RUN" != *"not implemented"* ]] && "$BIN" run --help >/dev/null 2>&1; then
  "$BIN" run --dry-run --node-name bench --verbs off --sysfs-root "$NODE/sys" --proc-root "$NODE/proc" \
    --metrics-addr "127.0.0.1:$FG_PORT" --interval "${FG_INTERVAL:-10s}" >/dev/null 2>&1 &
  FG_WHAT="fabricgate run --dry-run"
else
  "$HELPER" "$NODE" "127.0.0.1:$FG_PORT" &
  FG_WHAT="fabricgate (metrics_fixture example)"
fi
PIDS+=("$!")

wait_up() {
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2
  return 1
}
NE_URL="http://127.0.0.1:$NE_PORT/metrics"
FG_URL="http://127.0.0.1:$FG_PORT/metrics"
wait_up "$NE_URL"
wait_up "$FG_URL"
sleep 1.5 # let fabricgate finish its first probe

# The same port counter through both, so the comparison is of like with like.
NE_SERIES="$(curl -fsS "$NE_URL" | grep -c '^node_infiniband' || true)"
FG_SERIES="$(curl -fsS "$FG_URL" | grep -c '^fabricgate_' || true)"

scrape() { # URL -> N lines of seconds
  for _ in $(seq 1 "$N"); do
    curl -fsS -o /dev/null -w '%{time_total}\n' "$1"
  done
}
stats() { # stdin seconds -> "median_ms mean_ms"
  sort -g | awk '{a[NR]=$1; s+=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.3f %.3f\n", m*1000, s/NR*1000}'
}

scrape "$NE_URL" >/dev/null   # warm-up round for both
scrape "$FG_URL" >/dev/null
read -r NE_MED NE_MEAN < <(scrape "$NE_URL" | stats)
read -r FG_MED FG_MEAN < <(scrape "$FG_URL" | stats)

printf '%-44s %8s %10s %10s\n' "exporter ($N scrapes of $(basename "$NODE"))" series "median ms" "mean ms"
printf '%-44s %8s %10s %10s\n' "prometheus-node-exporter (infiniband only)" "$NE_SERIES" "$NE_MED" "$NE_MEAN"
printf '%-44s %8s %10s %10s\n' "$FG_WHAT" "$FG_SERIES" "$FG_MED" "$FG_MEAN"
awk -v a="$FG_MED" -v b="$NE_MED" 'BEGIN { printf "ratio fabricgate / node_exporter (median): %.3f (fabricgate %.1fx faster)\n", a / b, b / a }'
echo "note: node_exporter reads sysfs on every scrape; fabricgate serves the registry its probe loop filled."

CPU_SECONDS="${CPU_SECONDS:-120}"
SCRAPE_EVERY="${SCRAPE_EVERY:-15}"
if [ "$CPU_SECONDS" -gt 0 ]; then
  NE_PID="${PIDS[0]}"
  FG_PID="${PIDS[1]}"
  # One cgroup per exporter, so every thread's CPU is counted exactly.
  CG_KIND=none
  CG_DIRS=()
  if [ -w /sys/fs/cgroup/cpuacct ] && [ -f /sys/fs/cgroup/cpuacct/cpuacct.usage ]; then
    CG_KIND=v1; CG_BASE=/sys/fs/cgroup/cpuacct
  elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then
    CG_KIND=v2; CG_BASE=/sys/fs/cgroup
  fi
  if [ "$CG_KIND" != none ]; then
    for who in ne fg; do
      d="$CG_BASE/fabricgate-bench-$$-$who"
      mkdir "$d" 2>/dev/null || { CG_KIND=none; break; }
      CG_DIRS+=("$d")
    done
  fi
  if [ "$CG_KIND" != none ]; then
    echo "$NE_PID" >"${CG_DIRS[0]}/cgroup.procs" && echo "$FG_PID" >"${CG_DIRS[1]}/cgroup.procs" || CG_KIND=none
  fi
  cleanup_cg() {
    cleanup
    for d in "${CG_DIRS[@]}"; do
      # Move what is left back to the parent, then remove the group.
      if [ -f "$d/cgroup.procs" ]; then
        while read -r p; do echo "$p" >"$CG_BASE/cgroup.procs" 2>/dev/null || true; done <"$d/cgroup.procs"
      fi
      rmdir "$d" 2>/dev/null || true
    done
  }
  trap cleanup_cg EXIT
  cpu_ns() { # which(0 ne, 1 fg) -> CPU nanoseconds so far
    case "$CG_KIND" in
      v1) cat "${CG_DIRS[$1]}/cpuacct.usage" ;;
      v2) awk '/^usage_usec/ {printf "%d\n", $2 * 1000}' "${CG_DIRS[$1]}/cpu.stat" ;;
      *)
        local pid; pid=$([ "$1" = 0 ] && echo "$NE_PID" || echo "$FG_PID")
        sed 's/.*) //' "/proc/$pid/stat" | awk -v t="$(getconf CLK_TCK)" '{printf "%d\n", ($12 + $13) * 1e9 / t}'
        ;;
    esac
  }
  ne0="$(cpu_ns 0)"; fg0="$(cpu_ns 1)"
  end=$((SECONDS + CPU_SECONDS))
  scrapes=0
  while [ "$SECONDS" -lt "$end" ]; do
    curl -fsS -o /dev/null "$NE_URL"
    curl -fsS -o /dev/null "$FG_URL"
    scrapes=$((scrapes + 1))
    sleep "$SCRAPE_EVERY"
  done
  ne1="$(cpu_ns 0)"; fg1="$(cpu_ns 1)"
  case "$CG_KIND" in
    v1|v2) how="cgroup $CG_KIND CPU accounting, ns" ;;
    *) how="/proc/PID/stat utime+stime, 10 ms ticks" ;;
  esac
  awk -v n=$((ne1 - ne0)) -v f=$((fg1 - fg0)) -v s="$CPU_SECONDS" -v i="${FG_INTERVAL:-10s}" \
      -v e="$SCRAPE_EVERY" -v k="$scrapes" -v how="$how" 'BEGIN {
    nm = n / 1e6 * 60 / s; fm = f / 1e6 * 60 / s
    printf "CPU per minute at equal freshness (fabricgate probes every %s; both scraped every %ss, %d times in %ss; %s):\n", i, e, k, s, how
    printf "  prometheus-node-exporter (infiniband only)  %8.2f ms  (%.2f ms in all)\n", nm, n / 1e6
    printf "  fabricgate                                  %8.2f ms  (%.2f ms in all)\n", fm, f / 1e6
    if (nm > 0) printf "ratio fabricgate / node_exporter (CPU): %.2f\n", fm / nm
  }'
fi
