#!/usr/bin/env python3
"""Hold N TLS connections open against a running `fabricgate webhook` and report what the
server holds (docs/hardening.md, "The pod path").

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key \
        -out tls.crt -days 2 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1
    fabricgate webhook --preflight-image x --listen 127.0.0.1:18443 \
        --tls-cert-file tls.crt --tls-key-file tls.key &
    python3 scripts/webhook_flood.py 18443 $! idle 3000 tls.crt
    python3 scripts/webhook_flood.py 18443 $! slow 1000 tls.crt

`idle`: handshake, then nothing. `slow`: handshake, a request head's first line, then one
byte every 0.5 s (slowloris). Prints the server's descriptors and RSS at the peak, whether
/healthz is still answered, and how many connections the server closed 8 s later.
"""
import socket, ssl, sys, time, os, subprocess
port=int(sys.argv[1]); pid=int(sys.argv[2]); mode=sys.argv[3]; n=int(sys.argv[4]); ca=sys.argv[5]
ctx=ssl.create_default_context(cafile=ca)
def fds(): return len(os.listdir(f'/proc/{pid}/fd'))
def rss():
    for l in open(f'/proc/{pid}/status'):
        if l.startswith('VmRSS') or l.startswith('VmHWM'): print('  ',l.strip())
conns=[]; t=time.time(); fails=0
for i in range(n):
    try:
        s=socket.create_connection(('127.0.0.1',port),timeout=10)
        s=ctx.wrap_socket(s,server_hostname='127.0.0.1')
        if mode=='slow': s.send(b'POST /mutate HTTP/1.1\r\nHost: x\r\n')
        conns.append(s)
    except Exception as e: fails+=1
print(f'{mode}: {len(conns)} TLS connections open after {time.time()-t:.1f}s ({fails} failed); server fds {fds()}')
rss()
# healthz
def healthz():
    s=ctx.wrap_socket(socket.create_connection(('127.0.0.1',port),timeout=5),server_hostname='127.0.0.1')
    s.send(b'GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n'); d=s.recv(100); return d.split(b'\r\n')[0]
t0=time.time()
try: print('  healthz:',healthz(),f'{time.time()-t0:.2f}s')
except Exception as e: print('  healthz failed',e)
end=time.time()+8
while time.time()<end:
    if mode=='slow':
        for s in conns:
            try: s.send(b'a')
            except Exception: pass
    time.sleep(0.5)
closed=0
for s in conns:
    s.setblocking(False)
    try:
        d=s.recv(10)
        if d==b'': closed+=1
    except ssl.SSLWantReadError: pass
    except Exception: closed+=1
print(f'  after 8 s more: {closed}/{len(conns)} closed by the server; server fds {fds()}')
rss()
