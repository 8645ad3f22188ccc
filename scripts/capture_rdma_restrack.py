#!/usr/bin/env python3
"""Capture RDMA resource tracking replies byte for byte: what `rdma res show qp` asks the
kernel over NETLINK_RDMA (protocol 20). Writes, into OUTDIR:

  devices-NN.bin   the reply datagrams of RDMA_NLDEV_CMD_GET with NLM_F_DUMP (every device)
  qp-DEV-NN.bin    the reply datagrams of RDMA_NLDEV_CMD_RES_QP_GET with NLM_F_DUMP for the
                   device of index DEV (the kernel dumps QPs one device at a time: a dump
                   without RDMA_NLDEV_ATTR_DEV_INDEX is refused)
  qp-noindex-NN.bin  that refusal (an NLMSG_ERROR with -EINVAL)
  ports-DEV-NN.bin the reply datagrams of RDMA_NLDEV_CMD_PORT_GET with NLM_F_DUMP for the
                   device of index DEV (each port's state and physical state, what
                   `rdma link show` prints)

Each datagram is summarised on stdout. These files are the test data of
probes/src/runtime/restrack.rs (probes/tests/fixtures/restrack/). In the Soft-RoCE VM:
tests/vm/capture-restrack.sh. Needs no capability; run it in the PID namespace whose
processes' QPs should carry a PID (the kernel hides the owner from other namespaces).

    scripts/capture_rdma_restrack.py OUTDIR
"""
import os
import socket
import struct
import sys

NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5
RDMA_NLDEV_CMD_GET = 1
RDMA_NLDEV_CMD_PORT_GET = 5
RDMA_NLDEV_CMD_RES_QP_GET = 10
RDMA_NLDEV_ATTR_DEV_INDEX = 1
RDMA_NLDEV_ATTR_DEV_NAME = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3


def nl_type(op):
    return (RDMA_NL_NLDEV << 10) + op


def request(op, seq, attrs=b""):
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP
    return struct.pack("=IHHII", 16 + len(attrs), nl_type(op), flags, seq, 0) + attrs


def attr_u32(kind, value):
    return struct.pack("=HHI", 8, kind, value)


def messages(data):
    """(type, payload) of each netlink message in one datagram."""
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        yield kind, data[off + 16:off + length]
        off += (length + 3) & ~3


def attrs(payload):
    off = 0
    while off + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, off)
        if length < 4:
            break
        yield kind & 0x3FFF, payload[off + 4:off + length]
        off += (length + 3) & ~3


def dump(sock, req, out, prefix):
    """Send one dump request; save every reply datagram until NLMSG_DONE or an error."""
    sock.send(req)
    datagrams = []
    n = 0
    while True:
        data = sock.recv(1 << 20)
        name = f"{prefix}-{n:02d}.bin"
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        kinds = [k for k, _ in messages(data)]
        print(f"{name}: {len(data)} bytes, message types {kinds}")
        datagrams.append(data)
        n += 1
        if NLMSG_DONE in kinds or NLMSG_ERROR in kinds:
            return datagrams


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_RDMA)
    sock.bind((0, 0))
    devices = []
    for data in dump(sock, request(RDMA_NLDEV_CMD_GET, 1), out, "devices"):
        for kind, payload in messages(data):
            if kind != nl_type(RDMA_NLDEV_CMD_GET):
                continue
            fields = dict(attrs(payload))
            index = struct.unpack("=I", fields[RDMA_NLDEV_ATTR_DEV_INDEX])[0]
            name = fields[RDMA_NLDEV_ATTR_DEV_NAME].rstrip(b"\0").decode()
            devices.append((index, name))
    print(f"devices: {devices}")
    seq = 2
    for index, _ in devices:
        req = request(RDMA_NLDEV_CMD_RES_QP_GET, seq, attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, index))
        dump(sock, req, out, f"qp-{index}")
        seq += 1
    dump(sock, request(RDMA_NLDEV_CMD_RES_QP_GET, seq), out, "qp-noindex")
    seq += 1
    for index, _ in devices:
        req = request(RDMA_NLDEV_CMD_PORT_GET, seq, attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, index))
        dump(sock, req, out, f"ports-{index}")
        seq += 1


if __name__ == "__main__":
    main()
