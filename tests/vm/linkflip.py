#!/usr/bin/env python3
"""Set an interface up or down with one SIOCSIFFLAGS ioctl and print the wall clock (ns since
the epoch) right before and right after that system call: the port changes state between the
two, so latencies measured from the first are exact to within the call itself (unlike timing
`ip link set`, whose process start under emulation takes 0.1-0.8 s).

    linkflip.py IFNAME up|down
"""
import fcntl
import socket
import struct
import sys
import time

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ = "16sH14x"  # struct ifreq: ifr_name[16], ifr_flags (short), padding to 32 bytes


def main():
    name, state = sys.argv[1].encode(), sys.argv[2]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack(IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack(IFREQ, name, 0)))[1]
    flags = flags | IFF_UP if state == "up" else flags & ~IFF_UP
    request = struct.pack(IFREQ, name, flags)
    before = time.time_ns()
    fcntl.ioctl(sock, SIOCSIFFLAGS, request)
    after = time.time_ns()
    print(before, after)


if __name__ == "__main__":
    main()
