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
    /// Measure RDMA round trip (and with --bandwidth, RDMA WRITE bandwidth) to another
    /// node's agent; exit 0 reachable / 1 unreachable / 2 usage / 3 nothing could be measured.
    Ping(PingArgs),
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
    /// Static peers for the RDMA measurements (`host` or `host:port`, comma separated),
    /// in addition to `peers.static` and `peers.service`; needs `peers.enabled`.
    #[arg(long, value_delimiter = ',', value_name = "PEERS")]
    pub peers: Vec<String>,
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
