//! The probes crate's one error type. Every variant names the path or device involved and,
//! where there is one, what the operator should do.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot list {path}: {source}")]
    ReadDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// Attribute files are regular files; anything else could block or never end.
    #[error(
        "{path}: {what}, not a regular file; sysfs attributes are regular files, so this one \
         is not read (check what replaced it, or fix --sysfs-root)"
    )]
    NotRegular { path: PathBuf, what: &'static str },

    #[error(
        "{path}: larger than {limit} bytes; a sysfs attribute is at most one page, so this \
         one is not read (check what replaced it, or fix --sysfs-root)"
    )]
    TooLarge { path: PathBuf, limit: usize },

    #[error("{path}: unexpected content {content:?}: {expected}")]
    Parse {
        path: PathBuf,
        content: String,
        expected: &'static str,
    },

    #[error("{device}: {message}")]
    Verbs { device: String, message: String },

    /// The peer channel's key file (its content is never quoted: it holds secrets).
    #[error("peers key file {path}: {message}")]
    PeerKey { path: PathBuf, message: String },

    /// A netlink reply that is cut short, malformed, or an error from the kernel.
    #[error("{request}: {message}")]
    Netlink {
        request: &'static str,
        message: String,
    },

    /// The kernel has no RDMA netlink (`ib_core` not loaded, or no RDMA support at all).
    #[error(
        "no RDMA netlink in this kernel ({source}): ib_core is not loaded, so no queue pair \
         can be listed"
    )]
    RdmaNetlinkUnavailable {
        #[source]
        source: io::Error,
    },

    /// A pod's network namespace cannot be entered (to list its sockets or its RDMA devices).
    #[error(
        "cannot enter the network namespace {path}: {source}; looking into a pod's namespace needs \
         CAP_SYS_ADMIN (setns) and CAP_SYS_PTRACE (another user's /proc/<pid>/ns/net): add \
         them (deploy/overlays/runtime-transport)"
    )]
    Netns {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("{0}")]
    Other(String),
}

impl ProbeError {
    pub fn read(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Read {
            path: path.into(),
            source,
        }
    }

    pub fn parse(path: impl Into<PathBuf>, content: &str, expected: &'static str) -> Self {
        Self::Parse {
            path: path.into(),
            content: content.trim_end().to_owned(),
            expected,
        }
    }

    /// A netlink `request` whose reply was cut short or bad in some other way.
    pub fn netlink(request: &'static str, message: impl Into<String>) -> Self {
        Self::Netlink {
            request,
            message: message.into(),
        }
    }

    /// A netlink reply to `request` that the crate's framing could not read.
    pub fn netlink_malformed(request: &'static str, e: &impl std::fmt::Display) -> Self {
        Self::netlink(request, format!("malformed reply: {e}"))
    }

    /// The kernel's refusal of `request` (`errno`, positive), and what to do about it (`hint`,
    /// empty or starting with a space).
    pub fn netlink_refused(request: &'static str, errno: i32, hint: &str) -> Self {
        let os = std::io::Error::from_raw_os_error(errno);
        Self::netlink(request, format!("the kernel refused it: {os}{hint}"))
    }

    /// Bounded, stable label for metrics (`fabricgate_probe_errors_total{kind=...}`).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Read { .. }
            | Self::ReadDir { .. }
            | Self::NotRegular { .. }
            | Self::TooLarge { .. }
            | Self::RdmaNetlinkUnavailable { .. }
            | Self::Netns { .. } => "read",
            Self::Parse { .. } | Self::Netlink { .. } => "parse",
            Self::Verbs { .. } => "verbs",
            Self::PeerKey { .. } | Self::Other(_) => "other",
        }
    }
}

pub type Result<T, E = ProbeError> = std::result::Result<T, E>;
