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
            // `check` probes once; `run` sets the cadence from its --interval.
            counters_interval: None,
        }
    }
}
