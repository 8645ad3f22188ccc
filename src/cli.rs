//! Command-line interface: the flags every subcommand shares and the subcommands themselves.

use crate::config::Config;
use crate::error::{Error, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Roots, SelftestConfig};
use std::path::PathBuf;

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
    /// Root of the device nodes (`infiniband/uverbsN` is looked up beneath it).
    #[arg(long, default_value = "/dev", value_name = "DIR")]
    pub dev_root: PathBuf,
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
    #[arg(long, value_enum, default_value_t = crate::preflight::SelftestChoice::Auto)]
    pub selftest: crate::preflight::SelftestChoice,
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
            Some(text) => Config::parse(text).map_err(|e| match e {
                Error::ConfigParse { message, .. } => Error::ConfigParse {
                    path: "$FABRICGATE_REQUIREMENTS".into(),
                    message,
                },
                other => other,
            }),
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
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl WebhookArgs {
    /// The mutation this webhook applies, from its requirements file and flags.
    ///
    /// # Errors
    /// The requirements file's errors; [`Error::Usage`] for a relative --nccl-dir.
    pub fn mutation_config(&self) -> Result<crate::webhook::MutationConfig> {
        let (config, yaml) = match &self.config {
            Some(path) => {
                let config = Config::load(path)?;
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
        let mut m = crate::webhook::MutationConfig::new(&config, &yaml, &self.preflight_image);
        if !self.rdma_resource_prefixes.is_empty() {
            m.rdma_resource_prefixes = self.rdma_resource_prefixes.clone();
        }
        m.nccl_dir = self.nccl_dir.clone();
        m.preflight_args = self.preflight_args.clone();
        Ok(m)
    }
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    #[command(flatten)]
    pub probe: ProbeArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Bound on each port's test; default: `rdma.selftest_timeout` (2s).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
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
    /// Probe interval (jittered by up to 10%).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub interval: std::time::Duration,
    /// Re-read the Node this often even when the verdict is unchanged, to undo drift (someone
    /// removing the taint by hand); between resyncs an unchanged verdict costs no request.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub resync_interval: std::time::Duration,
    /// Address of the /metrics, /healthz and /readyz server.
    #[arg(long, default_value = "0.0.0.0:9464", value_name = "ADDR")]
    pub metrics_addr: std::net::SocketAddr,
    /// Log the Node writes instead of making them; needs no cluster.
    #[arg(long)]
    pub dry_run: bool,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
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
}

impl ProbeArgs {
    /// Load the requirements file (defaults without one).
    ///
    /// # Errors
    /// The config errors of [`Config::load`].
    pub fn load_config(&self) -> Result<Config> {
        match &self.config {
            Some(path) => Config::load(path),
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
        Ok(Roots::new(&self.sysfs_root, &self.proc_root))
    }

    pub fn probe_config(&self, config: &Config) -> ProbeConfig {
        ProbeConfig {
            verbs: self.verbs.into(),
            storage: config.storage_config(),
            netdev: fabricgate_probes::netdev::NetdevConfig {
                interfaces: config.fallback.netdevs.clone(),
            },
            selftest: SelftestConfig {
                schedule: config.rdma.selftest_schedule(),
                timeout: config.rdma.selftest_timeout(),
                devices: Some(config.rdma.devices.clone()),
            },
        }
    }
}
