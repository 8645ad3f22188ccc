#!/usr/bin/env bash
# The whole test suite (README.md's test command, which .ci/run runs): `cargo test --workspace`,
# with the real node's binary (tests/node.rs: one node, its scenarios in order, ~11 min that
# mostly wait on the kubelet's and the agent's own periods) beside it rather than in its turn
# between `metrics` and `probe`. The node runs in its own network and mount namespaces with
# its own control plane, so nothing of the others' is shared; one after the other, a warm CI
# run took ~27 min on 2 cores (docs/testing.md, "CI's wall time").
#
#   scripts/test.sh [FILTER...] [-- LIBTEST FLAGS...]
#
# The arguments go to both, as to `cargo test --workspace -- ARGS` (the node binary takes
# scenario-name filters and --skip). The node's output goes to target/test-node.log and is
# shown once both have ended; either failing fails the script (the node's status first).
# `cargo test --workspace` alone runs the node in its turn, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v jq >/dev/null 2>&1 || {
    echo "scripts/test.sh: jq not found; run ./scripts/setup-tests.sh" >&2
    exit 1
}
args=()
for a in "$@"; do
    [ "$a" = -- ] || args+=("$a")
done
cargo test --workspace --no-run
node_bin="$(cargo test --test node --no-run --message-format=json |
    jq -r 'select(.target.name == "node" and .executable != null) | .executable')"
[ -x "$node_bin" ] || {
    echo "scripts/test.sh: cargo named no node test binary ('$node_bin')" >&2
    exit 1
}
mkdir -p target
node_log="$PWD/target/test-node.log"
"$node_bin" "${args[@]}" >"$node_log" 2>&1 &
node_pid=$!
rc=0
FABRICGATE_NODE_BESIDE="$node_log" cargo test --workspace -- "${args[@]}" || rc=$?
node_rc=0
wait "$node_pid" || node_rc=$?
echo "=== tests/node.rs, run beside the rest ($node_log):"
cat "$node_log"
if [ "$node_rc" -ne 0 ]; then
    echo "scripts/test.sh: the real node's tests failed (exit $node_rc)" >&2
    exit "$node_rc"
fi
exit "$rc"
