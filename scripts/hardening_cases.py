#!/usr/bin/env python3
"""Run every case of docs/hardening.md against one fabricgate binary and print a Markdown
table: exit code (or state), wall time, peak RSS and the observation.

    python3 scripts/hardening_cases.py target/debug/fabricgate [--new]

`--new` passes the flags only the hardened binary knows (--stale-series-grace). Each case
runs in a fresh temporary directory with a one-HCA fake sysfs tree (as tests/common/sysfs.rs)
and binds 127.0.0.1 only.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BIN = os.path.abspath(sys.argv[1])
NEW = "--new" in sys.argv


def fake_tree(root, rate="400 Gb/sec (4X NDR)"):
    sys_dir = os.path.join(root, "sys")
    dev_rel = "devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0"
    port = os.path.join(sys_dir, dev_rel, "ports/1")
    os.makedirs(os.path.join(port, "counters"))
    os.makedirs(os.path.join(sys_dir, "class/infiniband"))
    os.symlink("../../" + dev_rel, os.path.join(sys_dir, "class/infiniband/mlx5_0"))
    files = {
        os.path.join(sys_dir, dev_rel, "node_type"): "1: CA\n",
        os.path.join(port, "rate"): rate + "\n",
        os.path.join(port, "link_layer"): "InfiniBand\n",
        os.path.join(port, "phys_state"): "5: LinkUp\n",
        os.path.join(port, "state"): "4: ACTIVE\n",
        os.path.join(port, "counters/port_xmit_data"): "1000\n",
        os.path.join(port, "counters/port_rcv_data"): "1000\n",
        os.path.join(port, "counters/symbol_error"): "0\n",
    }
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)
    os.makedirs(os.path.join(root, "proc/self"))
    with open(os.path.join(root, "proc/self/mountinfo"), "w") as f:
        f.write("21 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n")
    return sys_dir, os.path.join(root, "proc")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def get(port, path, timeout=3):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - any failure is the observation
        return None, type(e).__name__


def one_shot(args, timeout=30, limit_vm_kib=None, stdin=None):
    """Run BIN with args under /usr/bin/time; return (exit, seconds, peak RSS KiB, stderr)."""
    wrapper = ["/usr/bin/time", "-f", "TIME %e %M"]
    cmd = wrapper + [BIN] + args
    if limit_vm_kib:
        cmd = ["sh", "-c", f"ulimit -v {limit_vm_kib} && exec \"$0\" \"$@\""] + cmd
    started = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=stdin,
                           env={**os.environ, "KUBECONFIG": "/nonexistent"})
    except subprocess.TimeoutExpired:
        return "blocked (killed)", f"{timeout}+", "-", ""
    err = p.stderr.decode(errors="replace")
    rss = "-"
    for line in err.splitlines():
        if line.startswith("TIME "):
            rss = line.split()[2]
    return p.returncode, f"{time.monotonic() - started:.2f}", rss, err


class Agent:
    def __init__(self, tmp, args, nofile=None, env=None):
        self.sys_dir, self.proc_dir = fake_tree(tmp) if not os.path.exists(
            os.path.join(tmp, "sys")) else (os.path.join(tmp, "sys"), os.path.join(tmp, "proc"))
        self.port = free_port()
        self.log = open(os.path.join(tmp, f"agent-{self.port}.log"), "w+")
        shell = "exec \"$0\" \"$@\"" if nofile is None else f"ulimit -n {nofile} && exec \"$0\" \"$@\""
        cmd = ["sh", "-c", shell, BIN, "run", "--sysfs-root", self.sys_dir, "--proc-root",
               self.proc_dir, "--verbs", "off", "--dry-run", "--node-name", "n",
               "--metrics-addr", f"127.0.0.1:{self.port}"] + args
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                  env={**os.environ, "KUBECONFIG": "/nonexistent", **(env or {})})
        self.started = time.monotonic()

    def wait_ready(self, limit=20):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                return False
            if get(self.port, "/readyz", 1)[0] == 200:
                return True
            time.sleep(0.05)
        return False

    def text(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


ROWS = []


def row(case, exit_code, seconds, rss, note):
    ROWS.append(f"| {case} | {exit_code} | {seconds} | {rss} | {note} |")


def case_flood():
    with tempfile.TemporaryDirectory() as tmp:
        a = Agent(tmp, ["--interval", "100ms"], nofile=128)
        ready = a.wait_ready()
        conns = []
        for _ in range(400):
            try:
                conns.append(socket.create_connection(("127.0.0.1", a.port), timeout=1))
            except OSError:
                pass
        time.sleep(2)
        t0 = time.monotonic()
        status, _ = get(a.port, "/healthz", 3)
        took = time.monotonic() - t0
        mstatus, metrics = get(a.port, "/metrics", 3)
        errors = [l for l in metrics.splitlines() if l.startswith("fabricgate_probe_errors_total")
                  and not l.endswith(" 0")] if mstatus == 200 else ["(no /metrics)"]
        emfile = a.text().count("Too many open files")
        rss = rss_kib(a.p.pid)
        for c in conns:
            c.close()
        state = "running" if a.p.poll() is None else f"exited {a.p.returncode}"
        a.stop()
        row("400 idle connections, `ulimit -n 128`", state, f"/healthz {took:.2f}", rss,
            f"ready before: {ready}; /healthz: {status}; probe errors: {errors or 'none'}; "
            f"'Too many open files' in log: {emfile}")


def case_resync():
    with tempfile.TemporaryDirectory() as tmp:
        a = Agent(tmp, ["--interval", "100ms", "--resync-interval", "300000000000y"])
        time.sleep(5)
        state = "running" if a.p.poll() is None else f"{a.p.returncode}"
        health = get(a.port, "/healthz", 1)[0] if a.p.poll() is None else "-"
        panicked = "panicked" in a.text()
        rss = rss_kib(a.p.pid)
        took = f"{time.monotonic() - a.started:.2f}"
        a.stop()
        row("`run --resync-interval 300000000000y`", state, took, rss or "-",
            f"/healthz after 5 s: {health}; panic in log: {panicked}")


def case_interval():
    with tempfile.TemporaryDirectory() as tmp:
        a = Agent(tmp, ["--interval", "1ns"])
        time.sleep(5)
        if a.p.poll() is None:
            cpu = cpu_seconds(a.p.pid)
            rss = rss_kib(a.p.pid)
            a.stop()
            row("`run --interval 1ns`", "running", "5 (stopped)", rss,
                f"{cpu:.2f} CPU-seconds in 5 s")
        else:
            row("`run --interval 1ns`", a.p.returncode, f"{time.monotonic() - a.started:.2f}",
                "-", a.text().strip().splitlines()[-1][:120])
            a.stop()


def config_case(name, text, extra=None, timeout=60, vm=None):
    with tempfile.TemporaryDirectory() as tmp:
        sys_dir, proc_dir = fake_tree(tmp)
        path = os.path.join(tmp, "req.yaml")
        with open(path, "w") as f:
            f.write(text)
        code, secs, rss, err = one_shot(
            ["check", "--config", path, "--sysfs-root", sys_dir, "--proc-root", proc_dir,
             "--verbs", "off"] + (extra or []), timeout=timeout, limit_vm_kib=vm)
        msg = [l for l in err.splitlines()
               if not l.startswith(("TIME ", "Command exited", "Command terminated"))]
        row(name, code, secs, rss, (msg[-1] if msg else "")[:140].replace("|", "/"))


def path_case(name, make, timeout=10, vm=None):
    with tempfile.TemporaryDirectory() as tmp:
        sys_dir, proc_dir = fake_tree(tmp)
        path = make(tmp)
        code, secs, rss, err = one_shot(
            ["check", "--config", path, "--sysfs-root", sys_dir, "--proc-root", proc_dir,
             "--verbs", "off"], timeout=timeout, limit_vm_kib=vm)
        msg = [l for l in err.splitlines()
               if not l.startswith(("TIME ", "Command exited", "Command terminated"))]
        row(name, code, secs, rss, (msg[-1] if msg else "")[:140].replace("|", "/"))


def mkfifo(tmp):
    p = os.path.join(tmp, "fifo.yaml")
    os.mkfifo(p)
    return p


def case_closed_stdout():
    with tempfile.TemporaryDirectory() as tmp:
        sys_dir, proc_dir = fake_tree(tmp)
        started = time.monotonic()
        # bash: PIPESTATUS[0] is check's status.
        # The reader is gone before the first byte is written (`| true`; `| head -c1` races).
        p = subprocess.run(
            ["bash", "-c", f"'{BIN}' check --sysfs-root '{sys_dir}' --proc-root '{proc_dir}' "
             "--verbs off | true; echo ${PIPESTATUS[0]}"],
            capture_output=True)
        code = p.stdout.decode().strip()
        normal = subprocess.run([BIN, "check", "--sysfs-root", sys_dir, "--proc-root", proc_dir,
                                 "--verbs", "off"], capture_output=True).returncode
        row("`check \\| true` (stdout closed)", code, f"{time.monotonic() - started:.2f}", "-",
            f"exit code without the pipe: {normal}; panic on stderr: "
            f"{'panicked' in p.stderr.decode()}")


def case_rate():
    with tempfile.TemporaryDirectory() as tmp:
        fake_tree(tmp, rate="1e308 Gb/sec (4X NDR)")
        a = Agent(tmp, ["--interval", "100ms"])
        a.wait_ready()
        time.sleep(0.5)
        log = a.text()
        _, metrics = get(a.port, "/metrics")
        a.stop()
        label = ""
        for token in log.replace('"', " ").replace(",", " ").split():
            if "rate-gbps" in token:
                label = token.split("=", 1)[-1].split(":", 1)[-1]
                break
        raw = [l for l in metrics.splitlines() if l.startswith("fabricgate_rdma_port_rate_gbps{")]
        row("port `rate` of `1e308 Gb/sec`", "running", "-", "-",
            f"rate-gbps label value length: {len(label) if label else 'no label'}; "
            f"metric: {raw[0] if raw else '-'}")


def case_renames():
    with tempfile.TemporaryDirectory() as tmp:
        sys_dir, _ = fake_tree(tmp)
        extra = ["--stale-series-grace", "1s"] if NEW else []
        a = Agent(tmp, ["--interval", "50ms"] + extra)
        a.wait_ready()
        size0 = len(get(a.port, "/metrics")[1])
        cls = os.path.join(sys_dir, "class/infiniband")
        name = "mlx5_0"
        started = time.monotonic()
        for i in range(1, 301):
            new = f"mlx5_{i}"
            os.rename(os.path.join(cls, name), os.path.join(cls, new))
            name = new
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and f'device="{name}"' not in get(a.port, "/metrics")[1]:
                time.sleep(0.01)
        time.sleep(1.5)
        size1 = len(get(a.port, "/metrics")[1])
        rss = rss_kib(a.p.pid)
        a.stop()
        row("300 device renames" + (" (`--stale-series-grace 1s`)" if NEW else ""), "running",
            f"{time.monotonic() - started:.1f}", rss,
            f"/metrics {size0 / 1024:.1f} KB -> {size1 / 1024:.1f} KB")


def case_stall():
    """A probe frozen on a FIFO `rate` attribute after the first probe."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--probe-deadline", "2s", "--liveness-grace", "2s"] if NEW else []
        a = Agent(tmp, ["--interval", "500ms"] + extra)
        ready = a.wait_ready()
        rate = os.path.join(a.sys_dir,
                            "devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0/ports/1/rate")
        os.remove(rate)
        os.mkfifo(rate)
        t0 = time.monotonic()
        seen = {}
        while time.monotonic() - t0 < 12:
            for path in ("/readyz", "/healthz"):
                if path not in seen and get(a.port, path, 1)[0] != 200:
                    seen[path] = f"{time.monotonic() - t0:.2f} s"
            time.sleep(0.05)
        rss = rss_kib(a.p.pid)
        a.stop()
        row("probe frozen on a FIFO `rate`" + (" (`--probe-deadline 2s --liveness-grace 2s`)"
                                               if NEW else ""), "running", "12 (observed)", rss,
            f"ready before: {ready}; first non-200: /readyz {seen.get('/readyz', 'never')}, "
            f"/healthz {seen.get('/healthz', 'never')}")


def main():
    case_stall()
    case_flood()
    case_resync()
    case_interval()
    config_case("`lustre.statfs_timeout: 300000000000y`",
                "lustre:\n  statfs_timeout: 300000000000y\nmounts:\n  - path: /\n")
    config_case("400 KB `rdma.devices` glob", "rdma:\n  devices: \"" + "a" * 400 * 1024 + "\"\n")
    config_case("100 KB `rdma.devices` glob", "rdma:\n  devices: \"" + "a" * 100 * 1024 + "\"\n")
    config_case("`fallback.window: soon`", "fallback:\n  window: soon\n")
    config_case("nested YAML, 100,000 `[`", "rdma: " + "[" * 100_000 + "]" * 100_000 + "\n",
                timeout=120)
    path_case("`--config` a FIFO", mkfifo)
    path_case("`--config /dev/zero` (`ulimit -v 1 GiB`)", lambda _: "/dev/zero",
              vm=1024 * 1024)
    path_case("`--config` a directory", lambda tmp: tmp)
    case_closed_stdout()
    case_rate()
    case_renames()
    print(f"Binary: {BIN}\n")
    print("| case | exit | seconds | peak RSS KiB | observation |")
    print("|---|---|---|---|---|")
    for r in ROWS:
        print(r)


if __name__ == "__main__":
    main()
