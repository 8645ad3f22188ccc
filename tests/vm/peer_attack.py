#!/usr/bin/env python3
"""The red team's attacks on an agent's peer side channel, from a stranger without the pool's key:
run in the victim's VM by tests/vm/peers-scenarios.sh while the other VM's agent measures it.

    python3 peer_attack.py HOST PORT SECONDS

For SECONDS: 4 dribblers (each connects and sends one byte every 2 s, a new connection when the
responder cuts one) and up to 64 idle connections held open (connect-and-hold). Prints one JSON
object: how many dribble sessions there were and the longest one the responder let live, and
how many idle connections were opened and how many the responder answered or closed."""
import json
import select
import socket
import sys
import threading
import time

host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
stop = time.monotonic() + seconds
lock = threading.Lock()
result = {"dribble_sessions": 0, "dribble_longest_s": 0.0, "dribble_cut": 0,
          "hold_opened": 0, "hold_closed_by_responder": 0}


def add(key, value=1):
    with lock:
        result[key] += value


def dribble():
    while time.monotonic() < stop:
        try:
            s = socket.create_connection((host, port), 3)
        except OSError:
            time.sleep(0.2)
            continue
        started = time.monotonic()
        add("dribble_sessions")
        cut = False
        try:
            while time.monotonic() < stop and not cut:
                s.send(b"F")
                deadline = time.monotonic() + 2
                while not cut and time.monotonic() < deadline:
                    ready, _, _ = select.select([s], [], [], max(0.0, deadline - time.monotonic()))
                    if ready and not s.recv(4096):
                        cut = True
        except OSError:
            cut = True
        held = time.monotonic() - started
        with lock:
            result["dribble_longest_s"] = max(result["dribble_longest_s"], round(held, 2))
            if cut:
                result["dribble_cut"] += 1
        s.close()
        time.sleep(0.5)  # then try again: a slow stranger, not a connection flood


def hold():
    held = []
    while time.monotonic() < stop and len(held) < 64:
        try:
            held.append(socket.create_connection((host, port), 3))
            add("hold_opened")
        except OSError:
            time.sleep(0.2)
    while time.monotonic() < stop:
        time.sleep(0.5)
    for s in held:
        s.setblocking(False)
        try:
            s.recv(4096)  # an answer (BUSY) or the end: the responder dealt with it
            add("hold_closed_by_responder")
        except BlockingIOError:
            pass
        except OSError:
            add("hold_closed_by_responder")
        s.close()


threads = [threading.Thread(target=dribble) for _ in range(4)] + [threading.Thread(target=hold)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(result))
