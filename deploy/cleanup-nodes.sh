#!/usr/bin/env bash
# Remove everything fabricgate wrote on the Nodes: its labels, its taint and its conditions.
# Run it after `kubectl delete -f daemonset.yaml` (a running agent would write them again).
#
#   deploy/cleanup-nodes.sh            # every node
#   deploy/cleanup-nodes.sh NODE...    # the named nodes
#
# PREFIX      the label prefix (node.label_prefix), default fabricgate.io/
# Needs kubectl (1.27+ for --subresource) and jq. Touches nothing fabricgate does not own:
# labels outside PREFIX, other taints and other conditions stay as they are.
set -euo pipefail

PREFIX=${PREFIX:-fabricgate.io/}
TAINT="${PREFIX}unvalidated"
CONDITIONS='["FabricReady","RDMAReady","LustreReady"]'

if [ "$#" -gt 0 ]; then
    nodes=("$@")
else
    mapfile -t nodes < <(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
fi

for node in "${nodes[@]}"; do
    json=$(kubectl get node "$node" -o json)

    mapfile -t labels < <(jq -r --arg p "$PREFIX" \
        '.metadata.labels // {} | keys[] | select(startswith($p)) | . + "-"' <<<"$json")
    if [ "${#labels[@]}" -gt 0 ]; then
        kubectl label node "$node" "${labels[@]}"
    fi

    if jq -e --arg t "$TAINT" '[.spec.taints // [] | .[] | select(.key == $t)] | length > 0' \
        <<<"$json" >/dev/null; then
        kubectl taint node "$node" "${TAINT}-"
    fi

    # JSON patch by index, highest first, each guarded by a `test` of the condition's type so a
    # concurrent kubelet write that moved the list makes the patch fail instead of removing
    # the wrong condition (rerun the script then).
    patch=$(jq -c --argjson own "$CONDITIONS" '
        [.status.conditions // [] | to_entries[] | select(.value.type as $t | $own | index($t))]
        | sort_by(-.key)
        | map({op: "test", path: "/status/conditions/\(.key)/type", value: .value.type},
              {op: "remove", path: "/status/conditions/\(.key)"})' <<<"$json")
    if [ "$patch" != "[]" ]; then
        kubectl patch node "$node" --subresource=status --type=json -p "$patch"
    fi
done
