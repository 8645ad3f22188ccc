#!/usr/bin/env python3
"""The red-team peer-channel attacks against two real agents of a given binary, over
loopback (the before/after table of docs/hardening.md, "The peer channel").

    python3 benches/peer_attacks.py BIN v1|v2 name|dribble|hold|squatter

v1: a binary of protocol version 1 (35f8061; no key file); v2: this one (a key file is
written and given). Prints node-b's fabricgate_peer_errors_total for node-a and what the
attacker saw."""
import os, socket, subprocess, sys, threading, time, re, tempfile
BIN = sys.argv[1]; MODE = sys.argv[2]  # v1 or v2
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../tests/fixtures/ndr-8x400-healthy/sys")
d = tempfile.mkdtemp()
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
key = os.path.join(d, "key"); open(key, "w").write("6b1f0c3e9a2d4f5b8c7e6d5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c\n")
def agent(name, port, peers):
    cfg = os.path.join(d, name + ".yaml")
    extra = f"  key_file: {key}\n" if MODE == "v2" else ""
    open(cfg, "w").write(f'rdma:\n  devices: "mlx5_0"\npeers:\n  enabled: true\n  listen: "127.0.0.1:{port}"\n  interval: 1s\n  timeout: 2s\n{extra}')
    m = free()
    log = open(os.path.join(d, name + ".log"), "w")
    p = subprocess.Popen([BIN, "run", "--dry-run", "--node-name", name, "--interval", "1s", "--verbs", "off",
        "--metrics-addr", f"127.0.0.1:{m}", "--config", cfg, "--sysfs-root", FIX, "--peers", peers],
        stdout=subprocess.DEVNULL, stderr=log, env={"RUST_LOG": "info", "HOME": d, "PATH": "/usr/bin:/bin"})
    return p, m, os.path.join(d, name + ".log")
def scrape(m):
    try:
        s = socket.create_connection(("127.0.0.1", m), 2); s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        out = b""
        while True:
            b = s.recv(65536)
            if not b: break
            out += b
        return out.decode()
    except Exception: return ""
def errs(m, peer):
    t = scrape(m); r = {}
    for l in t.splitlines():
        if l.startswith("fabricgate_peer_errors_total{") and f'peer="{peer}"' in l:
            r[re.search(r'kind="(\w+)"', l).group(1)] = float(l.split()[-1])
    return r
pa, pb = free(), free()
victim = f"127.0.0.1:{pa}"
what = sys.argv[3]
if what == "squatter":
    sq = socket.socket(); sq.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); sq.bind(("127.0.0.1", pa)); sq.listen(8)
    B = agent("node-b", pb, victim)
    c, _ = sq.accept(); c.settimeout(5); c.recv(256)
    f = bytearray(256); f[:4] = b"FGPR"; f[4:6] = (1).to_bytes(2, "big"); f[6] = 2; f[7] = 3; f[8:14] = b"node-x"
    c.sendall(bytes(f)); time.sleep(0.5); c.close(); sq.close()
    A = agent("node-a", pa, f"127.0.0.1:{pb}")
    time.sleep(15)
    log = open(B[2]).read()
    print("squatter: b skipped lines:", len([l for l in log.splitlines() if "skipped" in l and victim in l]),
          "b sessions to a after the squat:", len([l for l in log.splitlines() if "peer measurement failed" in l and victim in l]),
          "errors:", errs(B[1], victim))
    A[0].kill(); B[0].kill(); sys.exit()
A = agent("node-a", pa, f"127.0.0.1:{pb}")
B = agent("node-b", pb, victim)
time.sleep(6)
print("before attack, b's errors for a:", errs(B[1], victim))
held = []
def src_conn(src):
    s = socket.socket(); s.bind((src, 0)); s.connect(("127.0.0.1", pa)); return s
stop = False
if what == "name":
    s = socket.create_connection(("127.0.0.1", pa)); f = bytearray(256); f[:4] = b"FGPR"; f[4:6] = (1).to_bytes(2, "big"); f[6] = 1
    s.sendall(bytes(f)); s.settimeout(5); r = s.recv(256); print("stranger's v1 HELLO answered:", r[:8].hex(), "names node-a:", b"node-a" in r)
    s2 = socket.create_connection(("127.0.0.1", pa)); f[4:6] = (2).to_bytes(2, "big"); f[6] = 6; s2.sendall(bytes(f)); s2.settimeout(5)
    r = s2.recv(512); print("stranger's v2 OPEN answered:", r[:8].hex(), "names node-a:", b"node-a" in r)
elif what == "dribble":
    lens = []
    def dribble(src):
        while not stop:
            t0 = time.time(); s = src_conn(src)
            for b in b"FGPR\x00\x01\x01\x00" + b"\x00" * 40:
                if stop: break
                try:
                    s.sendall(bytes([b])); s.settimeout(2)
                    r = s.recv(256)
                    if r == b"" or r: break
                except socket.timeout: continue
                except OSError: break
            lens.append(time.time() - t0); s.close()
    ts = [threading.Thread(target=dribble, args=(f"127.0.0.{9+i}",)) for i in range(4)]
    [t.start() for t in ts]; time.sleep(30); stop = True
    print("dribble: b's errors for a after 30 s:", errs(B[1], victim), "longest session held: %.1f s" % max(lens or [0]), "sessions:", len(lens))
    [t.join(timeout=5) for t in ts]
elif what == "hold":
    end = time.time() + 20; n = 0
    while time.time() < end:
        try:
            held.append(src_conn(f"127.0.0.{9 + n % 4}")); n += 1
        except OSError: pass
        time.sleep(0.1)
    print("hold: %d idle connections in 20 s, b's errors for a:" % n, errs(B[1], victim))
A[0].kill(); B[0].kill()
