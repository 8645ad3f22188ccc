//! Command-line interface: the flags every subcommand shares and the subcommands themselves.

use crate::config::Config;
use crate::error::{Error, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Roots, SelftestConfig};
use std::path::{Path, PathBuf};

/// `config` with every section a feature above `config` owns read and checked, so a wrong
/// value there stops the subcommand at start like any other; a parse error names `path`.
/// A feature with its own section adds its line here.
///
/// # Errors
/// The section's [`crate::config::FeatureSection::of`] errors.
pub fn checked(config: Config, path: &Path) -> Result<Config> {
    use crate::config::FeatureSection;
    crate::transport::settings::RuntimeSettings::of(&config).map_err(|e| e.in_config_file(path))?;
    crate::gang::settings::GangSettings::of(&config).map_err(|e| e.in_config_file(path))?;
    crate::dra::settings::DraSettings::of(&config).map_err(|e| e.in_config_file(path))?;
    crate::checks::registered()
        .validate(&config)
        .map_err(|e| e.in_config_file(path))?;
    Ok(config)
}

/// [`Config::load`] and [`checked`].
///
/// # Errors
/// As those.
pub fn load_config_file(path: &Path) -> Result<Config> {
    checked(Config::load(path)?, path)
}

#[derive(Debug, Parser)]
#[command(
    name = "fabricgate",
    version,
    about = "Validate a GPU node's RDMA fabric and shared storage"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Probe once, print the report and verdict, exit 0 (validated) / 1 (not) / 2 (usage) / 3 (cannot probe).
    Check(CheckArgs),
    /// Run as the node agent: probe on an interval, keep the Node's labels, taint and
    /// conditions true, serve /metrics, /healthz and /readyz.
    Run(RunArgs),
    /// Run only the loopback RC data-path self-test on every selected port and print the
    /// results; exit 0 all passed / 1 a port failed / 2 usage / 3 nothing could be tested.
    Selftest(SelftestArgs),
    /// Inside a worker pod (init container): check the RDMA devices, memlock limit and mounts
    /// this pod was given, then pin NCCL to the validated ports; exit 0 / 1 / 2 / 3 as `check`.
    Preflight(PreflightArgs),
    /// Serve the mutating admission webhook that adds preflight to opted-in pods.
    Webhook(WebhookArgs),
    /// Measure RDMA round trip (and with --bandwidth, RDMA WRITE bandwidth) to another
    /// node's agent; exit 0 reachable / 1 unreachable / 2 usage / 3 nothing could be measured.
    Ping(PingArgs),
    /// Cluster-level guard (Deployment, 2 replicas, leader election on a Lease): taint pool
    /// Nodes whose agent pod is missing or not Ready for --stale-after (`AgentNotRunning`).
    Guard(GuardArgs),
    /// Kueue admission-check controller (`fabricgate.io/fabric-preflight`; Deployment, 2
    /// replicas, leader election on a Lease): hold a Workload until its assigned nodes are
    /// validated and pass a gang-wide RDMA pre-flight (docs/gangs.md).
    AdmissionCheck(AdmissionCheckArgs),
    /// Remove every fabricgate mark from the Nodes (labels and annotations under the prefix,
    /// the taint, the conditions) and the agents' DeviceTaintRules, once the agents and the
    /// guard are gone (what `helm uninstall` runs); exit 0 done / 2 usage / other: refused.
    Cleanup(CleanupArgs),
}

#[derive(Debug, Args)]
pub struct CleanupArgs {
    /// Prefix of fabricgate's labels, annotations and taint (`node.label_prefix`).
    #[arg(long, default_value = crate::config::DEFAULT_LABEL_PREFIX, value_name = "PREFIX")]
    pub label_prefix: String,
    /// First wait until no pod of --namespace matches this label selector (repeatable): the
    /// agents and the guard would write the marks again.
    #[arg(long, value_name = "SELECTOR")]
    pub wait_for_pods: Vec<String>,
    /// Namespace of the pods waited for.
    #[arg(long, env = "POD_NAMESPACE", default_value = "fabricgate")]
    pub namespace: String,
    /// Longest wait for those pods to go.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    /// Only these Nodes (default: every Node).
    #[arg(value_name = "NODE")]
    pub nodes: Vec<String>,
}

#[derive(Debug, Args)]
pub struct AdmissionCheckArgs {
    /// Requirements file: the `gang:` section, and `node.label_prefix` / `node.pool_selector`
    /// (which Nodes are watched; empty: all).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Namespace of the Lease (the controller's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "fabricgate")]
    pub namespace: String,
    /// Name of the coordination.k8s.io Lease the replicas elect a leader on.
    #[arg(long, default_value = "fabricgate-admission-check")]
    pub lease_name: String,
    /// Lease duration: a leader that has not renewed for this long is replaced.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: std::time::Duration,
    /// How often the Lease is renewed (or tried) and the leader re-judges everything even
    /// when nothing changed (changes are judged at once).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub poll_interval: std::time::Duration,
    /// This replica's identity in the Lease (downward API metadata.name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Serve only the Workloads of this namespace (default: every namespace). With it, the
    /// controller's FabricChecks of other namespaces' Workloads are left alone too.
    #[arg(long, value_name = "NAMESPACE")]
    pub workload_namespace: Option<String>,
    // The agent's and the guard's flag name; `--metrics-listen`, the name before, is still
    // read (hidden) for one release.
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, alias = "metrics-listen", default_value = "0.0.0.0:9467", value_name = "ADDR", value_parser = crate::observe::server::parse_listen_addr)]
    pub metrics_addr: std::net::SocketAddr,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Args)]
pub struct PingArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// The peer: `host` or `host:port` of its agent's responder (port: `peers.listen`'s,
    /// default 9465).
    #[arg(value_name = "PEER")]
    pub peer: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Measure only from this local device (default: every usable port of `rdma.devices`).
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// RDMA WRITEs in the RTT burst (default `peers.rtt_messages`; at most 64).
    #[arg(long, value_name = "N")]
    pub count: Option<u32>,
    /// Bytes per RTT message (default `peers.rtt_message_size`).
    #[arg(long, value_name = "BYTES")]
    pub size: Option<u32>,
    /// Also run the RDMA WRITE bandwidth burst (sizes from `peers.bandwidth`).
    #[arg(long)]
    pub bandwidth: bool,
    /// Bytes per WRITE of the bandwidth burst (default `peers.bandwidth.message_size`).
    #[arg(long, value_name = "BYTES")]
    pub bw_size: Option<u32>,
    /// Length of the bandwidth burst (default `peers.bandwidth.duration`; at most 2s).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub bw_duration: Option<std::time::Duration>,
    /// Bound on the whole measurement per port (default `peers.timeout`).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub timeout: Option<std::time::Duration>,
    /// This node's name, told to the peer (it refuses to measure itself).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
}

#[derive(Debug, Args)]
pub struct PreflightArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// The requirements as YAML text, instead of --config (the webhook passes them so).
    #[arg(
        long,
        env = "FABRICGATE_REQUIREMENTS",
        value_name = "YAML",
        conflicts_with = "config"
    )]
    pub requirements: Option<String>,
    /// Shared emptyDir where `nccl.conf` and `nccl.env` are written on success.
    #[arg(long, default_value = "/fabricgate", value_name = "DIR")]
    pub nccl_dir: PathBuf,
    /// Where the problems (or the success line) are written for `kubectl describe pod`.
    #[arg(long, default_value = "/dev/termination-log", value_name = "FILE")]
    pub termination_log: PathBuf,
    /// Least RLIMIT_MEMLOCK (soft) that passes without CAP_IPC_LOCK: `unlimited` or a size
    /// (`64MiB`).
    #[arg(long, default_value = "unlimited", value_name = "SIZE")]
    pub min_memlock: fabricgate_probes::pod::Limit,
    /// Ports required in this pod; default `rdma.min_active_ports`.
    #[arg(long, value_name = "N")]
    pub min_active_ports: Option<u32>,
    /// Loopback RC self-test on each port: `auto` follows `rdma.selftest`.
    #[arg(long, value_enum, default_value_t = crate::pod::preflight::SelftestChoice::Auto)]
    pub selftest: crate::pod::preflight::SelftestChoice,
    /// `NCCL_NET` written to the NCCL files (`IB`; a net plugin's name where one is used).
    #[arg(long, default_value = "IB", value_name = "NAME")]
    pub nccl_net: String,
}

impl PreflightArgs {
    /// The requirements: inline text, the --config file, or the defaults; and the text
    /// itself (for the log).
    ///
    /// # Errors
    /// The config errors of [`Config::parse`] / [`Config::load`].
    pub fn load_config(&self) -> Result<Config> {
        match &self.requirements {
            Some(text) => {
                let path = Path::new("$FABRICGATE_REQUIREMENTS");
                checked(
                    Config::parse(text).map_err(|e| e.in_config_file(path))?,
                    path,
                )
            }
            None => self.probe.load_config(),
        }
    }
}

#[derive(Debug, Args)]
pub struct WebhookArgs {
    /// Requirements file (YAML): handed to every preflight init container, and its mount
    /// paths select which of the pod's volume mounts preflight gets.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to serve HTTPS on (`POST /mutate`, `GET /healthz`).
    #[arg(long, default_value = "0.0.0.0:8443", value_name = "ADDR")]
    pub listen: std::net::SocketAddr,
    /// Serving certificate chain (PEM); re-read when it changes.
    #[arg(
        long,
        default_value = "/etc/fabricgate-tls/tls.crt",
        value_name = "FILE"
    )]
    pub tls_cert_file: PathBuf,
    /// Private key of the serving certificate (PEM).
    #[arg(
        long,
        default_value = "/etc/fabricgate-tls/tls.key",
        value_name = "FILE"
    )]
    pub tls_key_file: PathBuf,
    /// How often the certificate files are checked for a change.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub cert_reload_interval: std::time::Duration,
    /// Image of the preflight init container (this webhook's own image).
    #[arg(long, env = "FABRICGATE_IMAGE", value_name = "IMAGE")]
    pub preflight_image: String,
    /// Resource-name prefix that marks a container as using RDMA devices (repeatable;
    /// replaces the defaults rdma/, nvidia.com/hostdev, nvidia.com/rdma, nvidia.com/sriov,
    /// mellanox.com/).
    #[arg(long = "rdma-resource-prefix", value_name = "PREFIX")]
    pub rdma_resource_prefixes: Vec<String>,
    /// Mount path of the NCCL emptyDir in the pod's containers.
    #[arg(long, default_value = "/fabricgate", value_name = "DIR")]
    pub nccl_dir: String,
    /// Extra argument for `fabricgate preflight` in the init container (repeatable), e.g.
    /// `--preflight-arg=--min-memlock=1GiB`.
    #[arg(long = "preflight-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub preflight_args: Vec<String>,
    /// Most connections open at once (lowered to what the open-file limit leaves); a new one
    /// that finds them all open closes the oldest idle one.
    #[arg(long, default_value_t = crate::pod::webhook::DEFAULT_MAX_CONNECTIONS,
          value_parser = parse_max_connections, value_name = "N")]
    pub max_connections: usize,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl WebhookArgs {
    /// The mutation this webhook applies, from its requirements file and flags.
    ///
    /// # Errors
    /// The requirements file's errors; [`Error::Usage`] for a relative --nccl-dir.
    pub fn mutation_config(&self) -> Result<crate::pod::webhook::MutationConfig> {
        let (config, yaml) = match &self.config {
            Some(path) => {
                let config = load_config_file(path)?;
                let yaml = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
                    path: path.clone(),
                    source,
                })?;
                (config, yaml)
            }
            None => (Config::default(), String::new()),
        };
        if !self.nccl_dir.starts_with('/') {
            return Err(Error::Usage {
                flag: "--nccl-dir".into(),
                message: format!("{:?} is not an absolute path", self.nccl_dir),
            });
        }
        let mut m = crate::pod::webhook::MutationConfig::new(&config, &yaml, &self.preflight_image);
        if !self.rdma_resource_prefixes.is_empty() {
            m.rdma_resource_prefixes = self.rdma_resource_prefixes.clone();
        }
        m.nccl_dir = self.nccl_dir.clone();
        m.preflight_args = self.preflight_args.clone();
        m.check()?;
        Ok(m)
    }
}

#[derive(Debug, Args)]
pub struct GuardArgs {
    /// Requirements file: `node.pool_selector` (the agent DaemonSet's nodeSelector; from the file
    /// `pool-selector` beside it when there is one), `node.label_prefix`, `node.taint_effect`
    /// and `node.breaker` are used.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Namespace of the agent pods and of the Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "fabricgate")]
    pub namespace: String,
    /// Label selector of the agent DaemonSet's pods (its template's `component: agent` label:
    /// the webhook's pods share the name label, and a Ready webhook pod is no live agent).
    #[arg(
        long,
        default_value = "app.kubernetes.io/name=fabricgate,app.kubernetes.io/component=agent"
    )]
    pub pod_selector: String,
    /// How long an agent pod may be missing or not Ready before its Node is tainted.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub stale_after: std::time::Duration,
    /// How often the guard renews or tries to take the Lease, and the leader re-judges its
    /// watch-fed cache even when nothing changed (no API reads): at most this late is a
    /// `--stale-after` deadline noticed (the leader also wakes for each one, and judges
    /// changes at once).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub poll_interval: std::time::Duration,
    /// How often the leader proves again that its admission policy confines it to the pool:
    /// a server-side dry run of its taint on a Node outside the pool must be refused (a
    /// deleted requirements ConfigMap or an edited policy lifts that). Also at each
    /// leadership's start.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    pub prove_every: std::time::Duration,
    /// Name of the coordination.k8s.io Lease the replicas elect a leader on.
    #[arg(long, default_value = "fabricgate-guard")]
    pub lease_name: String,
    /// Lease duration: a leader that has not renewed for this long is replaced.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: std::time::Duration,
    /// This replica's identity in the Lease (downward API metadata.name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Address of the guard's /metrics, /healthz and /readyz server (the agent's server, with
    /// its connection bounds).
    #[arg(long, default_value = "0.0.0.0:9466", value_name = "ADDR", value_parser = crate::observe::server::parse_listen_addr)]
    pub metrics_addr: std::net::SocketAddr,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Bound on each port's test, 1ms to 60s; default: `rdma.selftest_timeout` (2s).
    #[arg(long, value_parser = parse_selftest_timeout, value_name = "DURATION")]
    pub timeout: Option<std::time::Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// Name of the Node this agent guards (downward API `spec.nodeName`).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// The agent's namespace (downward API `metadata.namespace`): where the blast-radius
    /// breaker's ledger ConfigMap `fabricgate-breaker` lives.
    #[arg(
        long,
        env = "POD_NAMESPACE",
        default_value = "fabricgate",
        value_name = "NAMESPACE"
    )]
    pub namespace: String,
    /// Probe interval (jittered by up to 10%), 10ms to 1h.
    #[arg(long, default_value = "10s", value_parser = parse_interval)]
    pub interval: std::time::Duration,
    /// Re-read the Node this often even when the verdict is unchanged, to undo drift (someone
    /// removing the taint by hand); between resyncs an unchanged verdict costs no request.
    /// 100ms to 24h.
    #[arg(long, default_value = "60s", value_parser = parse_resync_interval)]
    pub resync_interval: std::time::Duration,
    /// Address of the /metrics, /healthz and /readyz server. In a DaemonSet, the node's own
    /// address: `$(HOST_IP):9464` with HOST_IP from the downward API `status.hostIP`.
    #[arg(long, default_value = "0.0.0.0:9464", value_name = "ADDR", value_parser = crate::observe::server::parse_listen_addr)]
    pub metrics_addr: std::net::SocketAddr,
    /// Most connections the metrics server keeps open at once (lowered further so they never
    /// take more than half of the descriptors left after a reserve for the probe).
    #[arg(long, default_value_t = crate::observe::server::DEFAULT_MAX_CONNECTIONS, value_parser = parse_max_connections, value_name = "N")]
    pub metrics_max_connections: usize,
    /// A probe that has not finished after this long is an agent error: /readyz fails at once
    /// and the condition says AgentError. 1s to 1h.
    #[arg(long, default_value = "60s", value_parser = parse_probe_deadline, value_name = "DURATION")]
    pub probe_deadline: std::time::Duration,
    /// /healthz fails once a probe has run past the deadline by this much, so the kubelet
    /// restarts a wedged agent. 0s to 1h.
    #[arg(long, default_value = "60s", value_parser = parse_liveness_grace, value_name = "DURATION")]
    pub liveness_grace: std::time::Duration,
    /// Series of a device (RDMA or netdev) that disappeared are dropped from /metrics after
    /// this long. 0s to 7 days.
    #[arg(long, default_value = "10m", value_parser = parse_stale_series_grace, value_name = "DURATION")]
    pub stale_series_grace: std::time::Duration,
    /// Log the Node writes instead of making them; needs no cluster.
    #[arg(long)]
    pub dry_run: bool,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Static peers for the RDMA measurements (`host` or `host:port`, comma separated),
    /// in addition to `peers.static` and `peers.service`; needs `peers.enabled`.
    #[arg(long, value_delimiter = ',', value_name = "PEERS")]
    pub peers: Vec<String>,
    /// Address of the peer responder, replacing `peers.listen` (the DaemonSet passes the
    /// node's own address, `$(HOST_IP):9465`); ignored without `peers.enabled`.
    #[arg(long, value_name = "ADDR")]
    pub peers_listen: Option<std::net::SocketAddr>,
}

/// Flags shared by every subcommand that probes.
#[derive(Debug, Clone, Args)]
pub struct ProbeArgs {
    /// Root of sysfs (fixture trees in tests).
    #[arg(long, default_value = "/sys", value_name = "DIR")]
    pub sysfs_root: PathBuf,
    /// Root of procfs.
    #[arg(long, default_value = "/proc", value_name = "DIR")]
    pub proc_root: PathBuf,
    /// Root of the device nodes (`infiniband/uverbsN` is looked up beneath it; libibverbs
    /// itself always opens `/dev`).
    #[arg(long, default_value = "/dev", value_name = "DIR")]
    pub dev_root: PathBuf,
    /// Requirements file (YAML).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Open verbs contexts (`required`) or trust sysfs alone (`off`).
    #[arg(long, value_enum, default_value_t = VerbsArg::Required)]
    pub verbs: VerbsArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerbsArg {
    Off,
    Required,
}

impl From<VerbsArg> for VerbsMode {
    fn from(v: VerbsArg) -> Self {
        match v {
            VerbsArg::Off => VerbsMode::Off,
            VerbsArg::Required => VerbsMode::Required,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// The pods section (docs/runtime-transport.md): every pod cgroup on this node that holds
    /// RDMA queue pairs or moves TCP to a non-local address, judged rdma / sockets / idle /
    /// unknown. `off` skips it. It never changes the exit code.
    #[arg(long, value_enum, default_value_t = OnOff::On, value_name = "on|off")]
    pub pods: OnOff,
    /// How long the pods section measures each pod's TCP (sample, wait, sample), 100ms to 10m;
    /// not waited when no pod process runs on this node.
    #[arg(long, default_value = "5s", value_parser = parse_pods_window, value_name = "DURATION")]
    pub pods_window: std::time::Duration,
    /// A kubeconfig for the pods section: each pod's peers are then the pods of its job on
    /// other nodes, as the agent judges them, and the pods are named. Without it (and outside
    /// a pod) any address not on this node counts as a peer, and the section says so.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// This node's name in the cluster (default: the host name), for the pods section.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl ProbeArgs {
    /// Load the requirements file (defaults without one).
    ///
    /// # Errors
    /// The config errors of [`Config::load`].
    pub fn load_config(&self) -> Result<Config> {
        match &self.config {
            Some(path) => load_config_file(path),
            None => Ok(Config::default()),
        }
    }

    /// The roots, checked to exist so a typo is a usage error rather than "no RDMA".
    ///
    /// # Errors
    /// [`Error::Usage`] when a root is not a directory.
    pub fn roots(&self) -> Result<Roots> {
        for (flag, dir) in [
            ("--sysfs-root", &self.sysfs_root),
            ("--proc-root", &self.proc_root),
        ] {
            if !dir.is_dir() {
                return Err(Error::Usage {
                    flag: flag.into(),
                    message: format!("{} is not a directory", dir.display()),
                });
            }
        }
        Ok(Roots::new(&self.sysfs_root, &self.proc_root).with_devfs(&self.dev_root))
    }

    pub fn probe_config(&self, config: &Config) -> ProbeConfig {
        ProbeConfig {
            verbs: self.verbs.into(),
            selftest: SelftestConfig {
                schedule: config.rdma.selftest_schedule(),
                timeout: config.rdma.selftest_timeout(),
                devices: Some(config.rdma.devices.as_str().to_owned()),
            },
            // `check` probes once and reads every counter file; `run` sets the cadence from its
            // --interval and reads only the files it exports.
            counters_interval: None,
            counter_names: Default::default(),
            // The device-plugin and own-mount checks are the agent's (`run`), about its pod.
            host: Default::default(),
            collectors: crate::checks::registered().collectors(config),
        }
    }
}

/// `clap` value parsers for durations with bounds (a value outside them is exit 2).
macro_rules! duration_flag {
    ($name:ident, $min:expr, $max:expr) => {
        fn $name(text: &str) -> std::result::Result<std::time::Duration, String> {
            crate::config::parse_bounded_duration(text, $min, $max)
        }
    };
}

// The minimums are far below anything useful in a deployment (10s, 60s) because the
// end-to-end tests run the agent fast; they only rule out a busy loop (`1ns`, `0s`).
duration_flag!(
    parse_interval,
    std::time::Duration::from_millis(10),
    std::time::Duration::from_secs(3600)
);
duration_flag!(
    parse_resync_interval,
    std::time::Duration::from_millis(100),
    std::time::Duration::from_secs(86_400)
);
duration_flag!(
    parse_probe_deadline,
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(3600)
);
duration_flag!(
    parse_liveness_grace,
    std::time::Duration::ZERO,
    std::time::Duration::from_secs(3600)
);
duration_flag!(
    parse_stale_series_grace,
    std::time::Duration::ZERO,
    std::time::Duration::from_secs(7 * 86_400)
);
duration_flag!(
    parse_pods_window,
    std::time::Duration::from_millis(100),
    std::time::Duration::from_secs(600)
);
duration_flag!(
    parse_selftest_timeout,
    std::time::Duration::from_millis(1),
    std::time::Duration::from_secs(60)
);

fn parse_max_connections(text: &str) -> std::result::Result<usize, String> {
    let max = crate::observe::server::MAX_MAX_CONNECTIONS;
    match text.trim().parse::<usize>() {
        Ok(n) if (2..=max).contains(&n) => Ok(n),
        _ => Err(format!("{text:?} is not a number from 2 to {max}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FeatureSection;

    /// Every subcommand loads the file through `cli::load_config_file`: a wrong value in the
    /// section stops it naming the key, an unknown key naming the file.
    #[test]
    fn a_wrong_dra_section_is_refused_at_load_naming_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("requirements.yaml");
        for (section, key) in [
            (
                "registry_dir: plugins_registry",
                "kubernetes.dra.registry_dir",
            ),
            ("drivers: [{name: Dra_Net}]", "kubernetes.dra.drivers"),
            ("slice_grace: 11m", "kubernetes.dra.slice_grace"),
            ("taint_scope: rack", "kubernetes.dra.taint_scope"),
            ("driver: [{name: dra.net}]", "kubernetes.dra"),
        ] {
            std::fs::write(&path, format!("kubernetes:\n  dra:\n    {section}\n")).unwrap();
            let e = load_config_file(&path).unwrap_err().to_string();
            assert!(e.contains(key), "{section}: {e}");
        }
        std::fs::write(
            &path,
            "kubernetes:\n  dra:\n    drivers: [{name: dra.net}]\n    taint_scope: both\n",
        )
        .unwrap();
        let c = load_config_file(&path).unwrap();
        let dra = crate::dra::settings::DraSettings::of(&c).unwrap();
        assert_eq!(dra.driver_names(), ["dra.net"]);
        assert_eq!(dra.taint_scope, crate::dra::settings::TaintScope::Both);
        let defaults = crate::dra::settings::DraSettings::of(&Config::default()).unwrap();
        assert!(!defaults.enabled(), "no section: DRA off");
    }

    #[test]
    fn a_wrong_runtime_section_is_refused_at_load_naming_its_key_or_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("requirements.yaml");
        std::fs::write(&path, "runtime:\n  window: 1s\n").unwrap();
        let e = load_config_file(&path).unwrap_err();
        assert!(e.to_string().contains("runtime.window"), "{e}");
        std::fs::write(&path, "runtime:\n  podselector: a\n").unwrap();
        let e = load_config_file(&path).unwrap_err().to_string();
        assert!(
            e.contains("podselector") && e.contains("requirements.yaml"),
            "{e}"
        );
        std::fs::write(&path, "runtime:\n  enabled: true\n  window: 20s\n").unwrap();
        let c = load_config_file(&path).unwrap();
        let s = crate::transport::settings::RuntimeSettings::of(&c).unwrap();
        assert!(s.enabled);
        assert_eq!(s.window, std::time::Duration::from_secs(20));
        // A section built in code reads back as it was given.
        let built = Config {
            runtime: crate::config::Section::holding("runtime", &s).unwrap(),
            ..Config::default()
        };
        assert_eq!(
            crate::transport::settings::RuntimeSettings::of(&built).unwrap(),
            s
        );
    }
}
