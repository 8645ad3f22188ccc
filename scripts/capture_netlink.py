#!/usr/bin/env python3
"""Capture what the kernel sends on the two netlink sockets fabricgate listens to, byte for
byte, while COMMANDs run: rtnetlink link messages (NETLINK_ROUTE, group RTMGRP_LINK) and
kernel uevents (NETLINK_KOBJECT_UEVENT, group 1). Each datagram is written to
OUTDIR/NN-rtnl.bin or OUTDIR/NN-uevent.bin and summarised on stdout. These files are the
test data of probes/src/events/parse.rs.

    unshare -n scripts/capture_netlink.py OUTDIR "ip link add v0 type veth peer name v1" ...

(in a private network namespace nothing on the host is touched; needs root). In the
Soft-RoCE VM: tests/vm/capture-netlink.sh.
"""
import os
import socket
import struct
import subprocess
import sys
import time


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rtnl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    rtnl.bind((0, 1))  # RTMGRP_LINK
    uevent = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
    uevent.bind((0, 1))  # the kernel's group
    for command in sys.argv[2:]:
        subprocess.run(command, shell=True, check=True)
    time.sleep(0.5)
    n = 0
    for name, sock in (("rtnl", rtnl), ("uevent", uevent)):
        sock.setblocking(False)
        while True:
            try:
                data, addr = sock.recvfrom(65536)
            except BlockingIOError:
                break
            with open(os.path.join(out, f"{n:02d}-{name}.bin"), "wb") as f:
                f.write(data)
            if name == "rtnl":
                kind = struct.unpack_from("=H", data, 4)[0]
                index, flags = struct.unpack_from("=iI", data, 20)
                what = f"type {kind} ifindex {index} flags {flags:#x}"
            else:
                what = data.split(b"\0")[0].decode(errors="replace")
            print(f"{n:02d}-{name}.bin {len(data)} bytes from {addr}: {what}")
            n += 1


if __name__ == "__main__":
    main()
