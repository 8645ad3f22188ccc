//! A real Kubernetes node for the tests (`tests/node.rs`): containerd 1.6 + runc and a kubelet
//! v1.37.x in a mount and network namespace of their own, with their own control plane
//! (etcd, kube-apiserver with `Node,RBAC` + `NodeRestriction`, kube-controller-manager,
//! kube-scheduler), a device plugin and a DRA kubelet plugin (`dra.rs`), all from the test
//! control plane binary (`tests/controlplane`, built by `.ci/controlplane.sh`). The recipe and
//! the reasons for each setting are in `docs/testing.md` ("The real node").
//!
//! Everything lives under one run directory (`$CARGO_TARGET_TMPDIR/realnode/run-PID`): state,
//! certificates, logs (`logs/*.log`, pod logs under `varlog/`). Nothing is written outside it
//! except the node's cgroups (`/sys/fs/cgroup/*/fgnode-PID`), which [`RealNode::teardown`]
//! removes. Processes are stopped by pid: the ones this harness started, then every process
//! still in the node's namespaces or cgroups (shims and containers), then the namespace
//! holder itself; [`RealNode::teardown`] returns whatever it could not remove.

use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The test control plane binary: `FABRICGATE_CONTROLPLANE`, else where `.ci/controlplane.sh`
/// installs it.
pub fn binary() -> String {
    std::env::var("FABRICGATE_CONTROLPLANE")
        .unwrap_or_else(|_| "/opt/fabricgate-controlplane/bin/controlplane".to_owned())
}
pub const NODE_IP: &str = "10.0.9.1";
pub const RESOURCE: &str = "rdma/hca_shared_devices_a";
/// The kubelet's status sync (`nodeStatusUpdateFrequency`, the default).
pub const STATUS_SYNC: Duration = Duration::from_secs(10);

/// Why the node could not start: a missing piece (a skip, or a failure under `CI=true`), or a
/// start that failed.
#[derive(Debug)]
pub enum StartError {
    Missing(String),
    Failed(String),
}

struct Proc {
    child: Child,
    program: String,
    args: Vec<String>,
}

pub struct RealNode {
    pub name: String,
    pub dir: PathBuf,
    pub logs: PathBuf,
    ns: Child,
    ns_mnt: String,
    ns_net: String,
    pub cgroup: String,
    procs: Mutex<BTreeMap<String, Proc>>,
    pub admin_token: String,
}

fn missing(what: &str) -> StartError {
    StartError::Missing(what.to_owned())
}

fn failed(what: impl Into<String>) -> StartError {
    StartError::Failed(what.into())
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn sh(script: &str) -> Result<String, String> {
    let out = Command::new("sh")
        .args(["-c", script])
        .output()
        .map_err(|e| format!("sh -c {script}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{script}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` every 100 ms until it is true; the time it took, or an error naming `what`.
pub fn wait_for(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> bool,
) -> Result<Duration, String> {
    let start = Instant::now();
    loop {
        if f() {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            return Err(format!("timed out after {limit:?} waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ns_inode(pid: u32, ns: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// The prerequisites, each named when absent.
fn check_prerequisites() -> Result<(), StartError> {
    let bin = binary();
    if !Path::new(&bin).exists() {
        return Err(missing(&format!(
            "{bin} (build it with .ci/controlplane.sh)"
        )));
    }
    for sub in ["deviceplugin", "draplugin"] {
        let probe = Command::new(&bin)
            .args([sub, "-h"])
            .output()
            .map_err(|e| failed(format!("{bin}: {e}")))?;
        if String::from_utf8_lossy(&probe.stderr).contains("unknown component") {
            return Err(missing(&format!(
                "the `{sub}` subcommand in {bin} (an older build: rerun .ci/controlplane.sh)"
            )));
        }
    }
    // SAFETY-free root check: /proc/self/status Uid line.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .is_some_and(|l| l.split_whitespace().nth(2) == Some("0"));
    if !root {
        return Err(missing("root (namespaces, mounts, cgroups)"));
    }
    for cmd in [
        "containerd",
        "ctr",
        "runc",
        "unshare",
        "nsenter",
        "ip",
        "openssl",
        "mount",
        "jq",
    ] {
        if !have(cmd) {
            return Err(missing(&format!("`{cmd}` (install with .ci/node.sh)")));
        }
    }
    if !Path::new("/usr/lib/cni/bridge").exists() {
        return Err(missing(
            "/usr/lib/cni/bridge (containernetworking-plugins; .ci/node.sh)",
        ));
    }
    Ok(())
}

const NS_SETUP: &str = r#"set -eu
D="$1"
ip link set lo up
ip link add fgnode0 type veth peer name fgnode1
ip addr add 10.0.9.1/24 dev fgnode0
ip link set fgnode0 up
ip link set fgnode1 up
ip route add default via 10.0.9.254 dev fgnode0 onlink
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p "$D/varlib-upper" "$D/varlib-work" "$D/varlog"
mount -t overlay overlay -o "lowerdir=/var/lib,upperdir=$D/varlib-upper,workdir=$D/varlib-work" /var/lib
mkdir -p /var/lib/kubelet
mount --bind "$D/kubelet" /var/lib/kubelet
mount --bind "$D/varlog" /var/log
# The kubelet (protectKernelDefaults false) writes these global sysctls: give it plain files.
mkdir -p "$D/sysctl"
for f in vm/overcommit_memory kernel/panic kernel/panic_on_oops; do
  n="$D/sysctl/$(echo "$f" | tr / _)"
  cat "/proc/sys/$f" > "$n"
  mount --bind "$n" "/proc/sys/$f"
done
# hostPath volumes with HostToContainer propagation need a shared mount.
mount --bind "$D/lustre" "$D/lustre"
mount --make-shared "$D/lustre"
echo ready > "$D/ns.ready"
exec sleep infinity
"#;

impl RealNode {
    /// Starts everything up to a Ready Node with the device plugin registered and the DRA
    /// plugin's ResourceSlice published.
    pub fn start(name: &str) -> Result<RealNode, StartError> {
        check_prerequisites()?;
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("realnode");
        let dir = base.join(format!("run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["logs", "kubelet", "containerd-root", "cni", "lustre", "pki"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|e| failed(format!("mkdir: {e}")))?;
        }
        let logs = dir.join("logs");
        let ns_log =
            std::fs::File::create(logs.join("ns.log")).map_err(|e| failed(e.to_string()))?;
        let ns_err = ns_log.try_clone().map_err(|e| failed(e.to_string()))?;
        let ns = Command::new("unshare")
            .args([
                "--mount",
                "--net",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                NS_SETUP,
                "ns-setup",
            ])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(ns_log)
            .stderr(ns_err)
            .process_group(0)
            .spawn()
            .map_err(|e| failed(format!("unshare: {e}")))?;
        let pid = ns.id();
        let mut node = RealNode {
            name: name.to_owned(),
            dir: dir.clone(),
            logs: logs.clone(),
            ns,
            ns_mnt: String::new(),
            ns_net: String::new(),
            cgroup: format!("fgnode-{}", std::process::id()),
            procs: Mutex::new(BTreeMap::new()),
            admin_token: random_hex(16),
        };
        let ready = dir.join("ns.ready");
        if let Err(e) = wait_for("the node namespace", Duration::from_secs(20), || {
            ready.exists()
        }) {
            let _ = node.teardown();
            return Err(failed(format!("{e}: {}", tail(&logs.join("ns.log"), 20))));
        }
        node.ns_mnt = ns_inode(pid, "mnt");
        node.ns_net = ns_inode(pid, "net");
        match node.bring_up() {
            Ok(()) => Ok(node),
            Err(e) => Err(failed(format!(
                "{e}\n(logs kept in {}; teardown left: {:?})",
                logs.display(),
                node.teardown()
            ))),
        }
    }

    fn bring_up(&self) -> Result<(), String> {
        self.make_pki()?;
        self.write_configs()?;
        let d = self.dir.display().to_string();
        let etcd_args = vec![
            "--name=default".into(),
            format!("--data-dir={d}/etcd"),
            "--listen-client-urls=http://127.0.0.1:2379".into(),
            "--advertise-client-urls=http://127.0.0.1:2379".into(),
            "--listen-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-cluster=default=http://127.0.0.1:2380".into(),
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        self.spawn("etcd", &binary(), &prepend("etcd", etcd_args))?;
        let p = format!("{d}/pki");
        let apiserver = vec![
            "--etcd-servers=http://127.0.0.1:2379".into(),
            "--bind-address=0.0.0.0".into(),
            format!("--advertise-address={NODE_IP}"),
            "--secure-port=6443".into(),
            format!("--cert-dir={p}/certs"),
            format!("--tls-cert-file={p}/apiserver.crt"),
            format!("--tls-private-key-file={p}/apiserver.key"),
            format!("--client-ca-file={p}/ca.crt"),
            "--service-cluster-ip-range=10.0.0.0/24".into(),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--disable-admission-plugins=TaintNodesByCondition".into(),
            format!("--token-auth-file={p}/tokens.csv"),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={p}/sa.pub"),
            format!("--service-account-signing-key-file={p}/sa.key"),
            format!("--audit-policy-file={d}/audit-policy.yaml"),
            format!("--audit-log-path={d}/logs/audit.log"),
            "--audit-log-mode=blocking".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            format!("--kubelet-client-certificate={p}/kubelet-client.crt"),
            format!("--kubelet-client-key={p}/kubelet-client.key"),
            "--kubelet-preferred-address-types=InternalIP".into(),
            // Webhooks reach their Service's endpoints directly: there is no kube-proxy.
            "--enable-aggregator-routing=true".into(),
        ];
        self.spawn("apiserver", &binary(), &prepend("apiserver", apiserver))?;
        wait_for("kube-apiserver /readyz", Duration::from_secs(120), || {
            self.kubectl(&["get", "--raw", "/readyz"])
                .is_ok_and(|o| o.trim() == "ok")
        })
        .map_err(|e| format!("{e}\n{}", tail(&self.logs.join("apiserver.log"), 30)))?;
        let kcm = vec![
            format!("--kubeconfig={d}/admin.kubeconfig"),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            // Each controller with its own service account, as kubeadm runs it: the
            // privileged-agent policy admits host access only from the DaemonSet
            // controller's (system:serviceaccount:kube-system:daemon-set-controller).
            "--use-service-account-credentials=true".into(),
            format!("--service-account-private-key-file={p}/sa.key"),
            format!("--root-ca-file={p}/ca.crt"),
            format!("--cluster-signing-cert-file={p}/ca.crt"),
            format!("--cluster-signing-key-file={p}/ca.key"),
        ];
        self.spawn(
            "controller-manager",
            &binary(),
            &prepend("controller-manager", kcm),
        )?;
        // DaemonSet pods are bound by the default scheduler too.
        let scheduler = vec![
            format!("--kubeconfig={d}/admin.kubeconfig"),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
        ];
        self.spawn("scheduler", &binary(), &prepend("scheduler", scheduler))?;
        self.spawn(
            "containerd",
            "containerd",
            &[format!("--config={d}/containerd.toml")],
        )?;
        wait_for("containerd", Duration::from_secs(30), || {
            self.ctr(&["version"]).is_ok()
        })
        .map_err(|e| format!("{e}\n{}", tail(&self.logs.join("containerd.log"), 30)))?;
        self.make_cgroups()?;
        self.start_kubelet()?;
        wait_for("the Node Ready", Duration::from_secs(90), || {
            self.node()
                .is_some_and(|n| condition(&n, "Ready").is_some_and(|c| c["status"] == "True"))
        })
        .map_err(|e| format!("{e}\n{}", tail(&self.logs.join("kubelet.log"), 40)))?;
        self.start_plugin()?;
        wait_for(
            "the plugin's resource allocatable",
            Duration::from_secs(60),
            || self.allocatable() == Some(4),
        )
        .map_err(|e| format!("{e}\n{}", tail(&self.logs.join("deviceplugin.log"), 20)))?;
        // The DeviceClass `dra.net` and the DRA plugin publishing the fixture's HCAs (dra.rs).
        self.bring_up_dra()
    }

    fn write_configs(&self) -> Result<(), String> {
        let d = self.dir.display().to_string();
        let w = |name: &str, text: String| {
            std::fs::write(self.dir.join(name), text).map_err(|e| format!("write {name}: {e}"))
        };
        w(
            "pki/tokens.csv",
            format!(
                "{},admin,admin-uid,system:masters\n{}-kubelet,system:node:{},node-uid,system:nodes\n",
                self.admin_token, self.admin_token, self.name
            ),
        )?;
        w(
            "audit-policy.yaml",
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived, ResponseStarted]\n\
             rules:\n  - level: Metadata\n"
                .into(),
        )?;
        let kubeconfig = |token: &str| {
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://{NODE_IP}:6443\n    \
                 certificate-authority: {d}/pki/ca.crt\nusers:\n- name: u\n  user:\n    token: {token}\n\
                 contexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
            )
        };
        w("admin.kubeconfig", kubeconfig(&self.admin_token))?;
        w(
            "kubelet.kubeconfig",
            kubeconfig(&format!("{}-kubelet", self.admin_token)),
        )?;
        w(
            "containerd.toml",
            format!(
                r#"version = 2
root = "{d}/containerd-root"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:3.10"
  # No CAP_SYS_RESOURCE on the CI machines: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni"
"#
            ),
        )?;
        w(
            "cni/10-bridge.conflist",
            r#"{"cniVersion": "1.0.0", "name": "realnode", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
"#
            .into(),
        )?;
        w(
            "kubelet.yaml",
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cg}
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication: {{anonymous: {{enabled: false}}, webhook: {{enabled: false}}, x509: {{clientCAFile: {d}/pki/ca.crt}}}}
authorization: {{mode: AlwaysAllow}}
resolvConf: /etc/resolv.conf
clusterDomain: cluster.local
clusterDNS: ["10.0.0.10"]
serializeImagePulls: false
evictionHard: {{memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
"#,
                cg = self.cgroup
            ),
        )?;
        Ok(())
    }

    fn make_pki(&self) -> Result<(), String> {
        let p = self.dir.join("pki");
        let run = |script: &str| sh(&format!("cd {} && {script} 2>&1", p.display()));
        run("openssl ecparam -name prime256v1 -genkey -noout -out ca.key")?;
        run("openssl req -x509 -new -key ca.key -subj /CN=fabricgate-node-ca -days 2 -out ca.crt")?;
        let cert = |name: &str, subj: &str, ext: &str| -> Result<(), String> {
            std::fs::write(p.join(format!("{name}.ext")), ext).map_err(|e| e.to_string())?;
            run(&format!(
                "openssl ecparam -name prime256v1 -genkey -noout -out {name}.key && \
                 openssl req -new -key {name}.key -subj '{subj}' -out {name}.csr && \
                 openssl x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
                 -extfile {name}.ext -out {name}.crt"
            ))
            .map(|_| ())
        };
        cert(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,IP:10.0.9.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n\
             extendedKeyUsage=serverAuth\n",
        )?;
        cert(
            "kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "extendedKeyUsage=clientAuth\n",
        )?;
        run(
            "openssl ecparam -name prime256v1 -genkey -noout -out sa.key && openssl ec -in sa.key -pubout -out sa.pub",
        )?;
        Ok(())
    }

    /// A cert for `dns` signed by the node's CA: (cert PEM, key PEM, CA PEM).
    pub fn serving_cert(
        &self,
        name: &str,
        dns: &[&str],
    ) -> Result<(String, String, String), String> {
        let p = self.dir.join("pki");
        let sans: Vec<String> = dns.iter().map(|d| format!("DNS:{d}")).collect();
        std::fs::write(
            p.join(format!("{name}.ext")),
            format!(
                "subjectAltName={}\nextendedKeyUsage=serverAuth\n",
                sans.join(",")
            ),
        )
        .map_err(|e| e.to_string())?;
        sh(&format!(
            "cd {} && openssl ecparam -name prime256v1 -genkey -noout -out {name}.key && \
             openssl req -new -key {name}.key -subj /CN={} -out {name}.csr && \
             openssl x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
             -extfile {name}.ext -out {name}.crt 2>&1",
            p.display(),
            dns[0]
        ))?;
        let r = |f: &str| std::fs::read_to_string(p.join(f)).map_err(|e| e.to_string());
        Ok((
            r(&format!("{name}.crt"))?,
            r(&format!("{name}.key"))?,
            r("ca.crt")?,
        ))
    }

    fn cgroup_dirs(&self) -> Vec<PathBuf> {
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("cgroup.procs").exists())
            .map(|p| p.join(&self.cgroup))
            .collect()
    }

    fn make_cgroups(&self) -> Result<(), String> {
        for dir in self.cgroup_dirs() {
            std::fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let (Some(parent), true) = (dir.parent(), dir.join(f).exists()) {
                    let v = std::fs::read_to_string(parent.join(f)).unwrap_or_default();
                    std::fs::write(dir.join(f), v.trim())
                        .map_err(|e| format!("write {}/{f}: {e}", dir.display()))?;
                }
            }
        }
        Ok(())
    }

    pub fn start_kubelet(&self) -> Result<(), String> {
        let d = self.dir.display().to_string();
        self.spawn(
            "kubelet",
            &binary(),
            &[
                "kubelet".into(),
                format!("--config={d}/kubelet.yaml"),
                format!("--kubeconfig={d}/kubelet.kubeconfig"),
                format!("--hostname-override={}", self.name),
                format!("--node-ip={NODE_IP}"),
                "--node-labels=nvidia.com/gpu.present=true".into(),
                "--v=2".into(),
            ],
        )
    }

    pub fn start_plugin(&self) -> Result<(), String> {
        self.spawn(
            "deviceplugin",
            &binary(),
            &[
                "deviceplugin".into(),
                format!("--resource={RESOURCE}"),
                "--devices=4".into(),
            ],
        )
    }

    /// The node's network namespace (`/proc/<holder>/ns/net`), to enter from a thread.
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.ns.id()))
    }

    /// `cmd` inside the node's mount and network namespaces.
    pub fn nsenter(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.ns.id().to_string(), "-m", "-n", "--", program]);
        c
    }

    /// Starts `program args` in the node namespaces as `name` (log `logs/NAME.log`).
    pub fn spawn(&self, name: &str, program: &str, args: &[String]) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{name}.log")))
            .map_err(|e| format!("log of {name}: {e}"))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = self
            .nsenter(program)
            .args(args)
            .env("CONTROLPLANE_EXIT_WITH_PARENT", "1")
            .env("HOME", &self.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("start {name}: {e}"))?;
        let mut procs = self.procs.lock().map_err(|_| "procs lock")?;
        procs.insert(
            name.to_owned(),
            Proc {
                child,
                program: program.to_owned(),
                args: args.to_vec(),
            },
        );
        Ok(())
    }

    /// Sends `signal` to the process started as `name`; with SIGKILL/SIGTERM waits for it.
    pub fn signal(&self, name: &str, signal: &str) -> Result<u32, String> {
        let mut procs = self.procs.lock().map_err(|_| "procs lock")?;
        let proc = procs.get_mut(name).ok_or(format!("no process {name}"))?;
        let pid = proc.child.id();
        sh(&format!("kill -{signal} {pid}"))?;
        if signal == "KILL" || signal == "TERM" {
            let _ = proc.child.wait();
        }
        Ok(pid)
    }

    /// Starts `name` again with the arguments it had.
    pub fn restart(&self, name: &str) -> Result<(), String> {
        let (program, args) = {
            let procs = self.procs.lock().map_err(|_| "procs lock")?;
            let p = procs.get(name).ok_or(format!("no process {name}"))?;
            (p.program.clone(), p.args.clone())
        };
        self.spawn(name, &program, &args)
    }

    /// The audit log's length: a mark for [`RealNode::audit_events`].
    pub fn audit_mark(&self) -> u64 {
        std::fs::metadata(self.dir.join("logs/audit.log"))
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// The API server's audit events after byte `mark` of its log.
    pub fn audit_events(&self, mark: u64) -> Vec<Value> {
        let text = std::fs::read(self.dir.join("logs/audit.log")).unwrap_or_default();
        text.get(usize::try_from(mark).unwrap_or(0)..)
            .map(String::from_utf8_lossy)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .collect()
    }

    /// The guard replicas' last log lines (or why they could not be read), for a failure.
    pub fn guard_logs(&self) -> String {
        self.kubectl(&[
            "logs",
            "-n",
            "fabricgate",
            "-l",
            "app.kubernetes.io/name=fabricgate-guard",
            "--tail=20",
        ])
        .unwrap_or_else(|e| e)
    }

    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.kubectl_stdin(args, None)
    }

    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        use std::io::Write;
        let kubeconfig = format!("--kubeconfig={}/admin.kubeconfig", self.dir.display());
        let mut child = self
            .nsenter(&binary())
            .arg("kubectl")
            .arg(&kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("kubectl: {e}"))?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes()).map_err(|e| e.to_string())?;
        }
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    pub fn apply(&self, manifest: &str) -> Result<String, String> {
        self.kubectl_stdin(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            Some(manifest),
        )
    }

    pub fn get_json(&self, args: &[&str]) -> Option<Value> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        self.kubectl(&a)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
    }

    pub fn node(&self) -> Option<Value> {
        self.get_json(&["node", &self.name])
    }

    /// The plugin resource's allocatable on the Node (None: not in the map).
    pub fn allocatable(&self) -> Option<i64> {
        self.node()?
            .pointer(&format!(
                "/status/allocatable/{}",
                RESOURCE.replace('/', "~1")
            ))?
            .as_str()?
            .parse()
            .ok()
    }

    pub fn ctr(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .nsenter("ctr")
            .args(["-a", "/run/containerd/containerd.sock", "-n", "k8s.io"])
            .args(args)
            .output()
            .map_err(|e| format!("ctr: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "ctr {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Imports an OCI archive and names its image `name`. An archive whose
    /// `org.opencontainers.image.ref.name` is a full name (`.ci/image.sh`'s) is imported under
    /// it; one with a bare tag (`tests/node/images.sh`'s) under `localhost/fgimport:TAG`.
    pub fn import_image(&self, archive: &Path, name: &str) -> Result<(), String> {
        let archive = archive
            .canonicalize()
            .map_err(|e| format!("{}: {e}", archive.display()))?;
        let index = Command::new("tar")
            .arg("-xOf")
            .arg(&archive)
            .arg("index.json")
            .output()
            .map_err(|e| format!("tar {}: {e}", archive.display()))?;
        let index: Value = serde_json::from_slice(&index.stdout)
            .map_err(|e| format!("index.json of {}: {e}", archive.display()))?;
        let ref_name = index
            .pointer("/manifests/0/annotations/org.opencontainers.image.ref.name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let path = archive.display().to_string();
        let imported = if ref_name.contains('/') {
            self.ctr(&["images", "import", &path])?;
            ref_name
        } else {
            self.ctr(&[
                "images",
                "import",
                "--base-name",
                "localhost/fgimport",
                &path,
            ])?;
            format!("localhost/fgimport:{ref_name}")
        };
        if imported != name {
            let _ = self.ctr(&["images", "rm", name]);
            self.ctr(&["images", "tag", &imported, name])?;
        }
        Ok(())
    }

    /// Every pid in the node's namespaces or cgroups (the holder excepted).
    fn node_pids(&self) -> Vec<u32> {
        let mut pids = std::collections::BTreeSet::new();
        let holder = self.ns.id();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == holder {
                continue;
            }
            let mnt = ns_inode(pid, "mnt");
            let net = ns_inode(pid, "net");
            let in_ns = (!self.ns_mnt.is_empty() && mnt == self.ns_mnt)
                || (!self.ns_net.is_empty() && net == self.ns_net);
            let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            let in_cg = cg.lines().any(|l| {
                l.contains(&format!(":/{}/", self.cgroup))
                    || l.ends_with(&format!(":/{}", self.cgroup))
            });
            if in_ns || in_cg {
                pids.insert(pid);
            }
        }
        pids.into_iter().collect()
    }

    /// Stops everything by pid, removes the cgroups; returns what is left (empty: clean).
    pub fn teardown(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        let order = [
            "draplugin",
            "deviceplugin",
            "kubelet",
            "scheduler",
            "controller-manager",
            "apiserver",
            "etcd",
            "containerd",
        ];
        if let Ok(mut procs) = self.procs.lock() {
            for name in order {
                if let Some(p) = procs.get_mut(name) {
                    let _ = sh(&format!("kill -TERM {} 2>/dev/null", p.child.id()));
                }
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            for p in procs.values_mut() {
                while Instant::now() < deadline {
                    if !matches!(p.child.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
            procs.clear();
        }
        // Shims and containers outlive containerd.
        for _ in 0..50 {
            let pids = self.node_pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = sh(&format!("kill -KILL {pid} 2>/dev/null"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.ns.kill();
        let _ = self.ns.wait();
        for pid in self.node_pids() {
            left.push(format!(
                "process {pid} still in the node's namespaces or cgroups"
            ));
        }
        // Deepest cgroups first.
        for root in self.cgroup_dirs() {
            if !root.exists() {
                continue;
            }
            let out = sh(&format!("find {} -depth -type d", root.display())).unwrap_or_default();
            for d in out.lines() {
                for _ in 0..20 {
                    if std::fs::remove_dir(d).is_ok() || !Path::new(d).exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if root.exists() {
                left.push(format!("cgroup {} left", root.display()));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let d = self.dir.display().to_string();
        for line in mounts.lines().filter(|l| l.contains(&d)) {
            left.push(format!("mount left: {line}"));
        }
        left
    }
}

fn prepend(first: &str, mut rest: Vec<String>) -> Vec<String> {
    rest.insert(0, first.to_owned());
    rest
}

pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn condition(node: &Value, kind: &str) -> Option<Value> {
    node.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

pub fn has_taint(node: &Value, key: &str) -> bool {
    node.pointer("/spec/taints")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t["key"] == key))
}

pub fn label(node: &Value, key: &str) -> Option<String> {
    node.pointer("/metadata/labels")?
        .get(key)?
        .as_str()
        .map(str::to_owned)
}
