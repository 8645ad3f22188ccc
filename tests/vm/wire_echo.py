#!/usr/bin/env python3
"""Check the emulated wire under rxe0 on its own, without RDMA: ICMP echo requests out of one
interface to the other VM's address on it, until one is answered or SECONDS pass. Prints one
JSON object: whether the wire answered, after how many requests, the round trip of the answer
and the wall time spent.

    wire_echo.py IFNAME ADDRESS SECONDS

Run before a one-shot RDMA client such as perftest after its link came back: its QP's move to
RTR resolves the peer's MAC with ARP, and the kernel gives that 1 s (ib_core's
rdma_addr_find_l2_eth_by_grh), a budget an emulated pair can overrun; an answered echo leaves
the neighbour entry resolved. In a failed run it tells a dead wire from a failure of RDMA.
(Debian's ping is not on these machines; a raw socket needs no package.) Exit status 0 when
answered, 1 when not."""
import json
import os
import socket
import struct
import sys
import time

ECHO_REQUEST, ECHO_REPLY = 8, 0


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def request(ident, seq):
    body = b"fabricgate-wire"
    header = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, checksum(header + body), ident, seq) + body


def main():
    ifname, address, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ident = os.getpid() & 0xFFFF
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode() + b"\0")
    started = time.monotonic()
    deadline = started + seconds
    result = {"interface": ifname, "address": address, "answered": False, "requests": 0}
    seq = 0
    while time.monotonic() < deadline and not result["answered"]:
        seq += 1
        sent = time.monotonic()
        sock.sendto(request(ident, seq), (address, 0))
        result["requests"] = seq
        # One request a second: ARP's own retransmission interval.
        wait_until = min(deadline, sent + 1.0)
        while time.monotonic() < wait_until:
            sock.settimeout(max(0.001, wait_until - time.monotonic()))
            try:
                packet, (source, _) = sock.recvfrom(2048)
            except socket.timeout:
                break
            ihl = (packet[0] & 0x0F) * 4
            kind, _, _, their_ident, _ = struct.unpack("!BBHHH", packet[ihl : ihl + 8])
            if source == address and kind == ECHO_REPLY and their_ident == ident:
                result["answered"] = True
                result["rtt_ms"] = round((time.monotonic() - sent) * 1e3, 1)
                break
    result["elapsed_ms"] = round((time.monotonic() - started) * 1e3, 1)
    print(json.dumps(result))
    return 0 if result["answered"] else 1


if __name__ == "__main__":
    sys.exit(main())
