# Run inside the Soft-RoCE VM by tests/vm/run.sh: capture the uevents of `rdma link add` and
# the rtnetlink message of `ip link set eth0 down` byte for byte into $FG_OUT/capture
# (scripts/capture_netlink.py), for probes/src/events/testdata/.
#
#   tests/vm/run.sh -o /tmp/capture tests/vm/capture-netlink.sh
# shellcheck shell=sh
set -eu
modprobe -d "$FG_KROOT" -S "$FG_KVER" crc32_generic
modprobe -d "$FG_KROOT" -S "$FG_KVER" rdma_rxe
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
python3 "$FG_CWD/scripts/capture_netlink.py" "$FG_OUT/capture" \
    "rdma link add rxe0 type rxe netdev eth0" "sleep 1" "ip link set eth0 down"
