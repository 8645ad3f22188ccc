#!/usr/bin/env bash
# Instructions per probe + policy over a fixture tree, counted by valgrind's callgrind: stable
# on a noisy machine, so a regression shows as a number (benches/README.md keeps the figures).
#
#   benches/callgrind_probe.sh [NODE_DIR]        (default: tests/fixtures/bench-12x2)
#
# One probe = (instructions of 11 probes - instructions of 1 probe) / 10: process start-up and
# the first probe (which opens every attribute file) cancel out. The first probe is reported
# on its own. Needs valgrind (apt-get install -y valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
NODE="${1:-tests/fixtures/bench-12x2}"
command -v valgrind >/dev/null || { echo "install valgrind" >&2; exit 2; }
cargo build --release --quiet --example probe_loop --example mountinfo_parse
BIN=target/release/examples/probe_loop
PARSE=target/release/examples/mountinfo_parse
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

instr() { # N MODE -> total instructions (Ir)
  valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$1.$2" "$BIN" "$NODE" "$1" "$2" \
    >/dev/null 2>"$OUT/log.$1.$2"
  grep -E '^(summary|totals):' "$OUT/cg.$1.$2" | head -1 | awk '{print $2}'
}

parse_instr() { # N -> total instructions of N parses of the 2,000-line table
  valgrind --tool=callgrind --callgrind-out-file="$OUT/mi.$1" "$PARSE" "$1" >/dev/null 2>"$OUT/milog.$1"
  grep -E '^(summary|totals):' "$OUT/mi.$1" | head -1 | awk '{print $2}'
}

I0=$(instr 0 counters)
I1=$(instr 1 counters)
I11=$(instr 11 counters)
A1=$(instr 1 agent)
A11=$(instr 11 agent)
V11=$(instr 11 verdict)
per=$(( (I11 - I1) / 10 ))
per_a=$(( (A11 - A1) / 10 ))
per_v=$(( (V11 - I1) / 10 ))
printf '%-58s %14s\n' "callgrind over $(basename "$NODE")" "instructions"
printf '%-58s %14d\n' "first probe + policy (opens every attribute file)" $((I1 - I0))
printf '%-58s %14d\n' "one probe + policy, every counter file read (check)" "$per"
printf '%-58s %14d\n' "one probe + policy, the agent's counter files read" "$per_a"
printf '%-58s %14d\n' "one probe + policy, verdict attributes only" "$per_v"
M1=$(parse_instr 1)
M11=$(parse_instr 11)
printf '%-58s %14d\n' "parse a 2,000-line mountinfo (benches/storage.rs table)" $(( (M11 - M1) / 10 ))
