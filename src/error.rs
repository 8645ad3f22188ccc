//! The agent crate's one error type.

use std::path::PathBuf;

/// `fabricgate check` exit codes (docs/configuration.md, Exit codes).
pub const EXIT_VALIDATED: u8 = 0;
pub const EXIT_NOT_VALIDATED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_CANNOT_PROBE: u8 = 3;
/// `run`, `guard`, `admission-check`, `webhook`: a task panicked; the process ends so that it is
/// restarted
/// (docs/hardening.md).
pub const EXIT_AGENT_PANIC: u8 = 70;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("cannot read config file {path}: {source}")]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("config file {path}: {message}")]
    ConfigParse { path: PathBuf, message: String },

    #[error("config {key}: {message}")]
    ConfigValue { key: String, message: String },

    #[error("{flag}: {message}")]
    Usage { flag: String, message: String },

    #[error("no Kubernetes configuration: {message}")]
    KubeConfig { message: String },

    #[error("Node {node} does not exist; check --node-name/NODE_NAME (downward API spec.nodeName)")]
    NodeNotFound { node: String },

    #[error("cannot {action} Node {node}: {}{}", describe(.source), forbidden_hint(.source))]
    Kube {
        action: &'static str,
        node: String,
        #[source]
        source: Box<kube::Error>,
    },

    #[error("cannot {action} {object}: {}{}", describe(.source), object_hint(.source))]
    KubeObject {
        action: &'static str,
        /// Kind and name (`Workload team-a/train`, `Lease fabricgate/fabricgate-guard`).
        object: String,
        #[source]
        source: Box<kube::Error>,
    },

    #[error(
        "Node {node}: the taint write conflicted {attempts} times in a row with other writers; \
         will retry"
    )]
    Conflict { node: String, attempts: u32 },

    #[error("internal error: {message}")]
    Internal { message: String },

    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// kube's `Display` of an API error repeats the whole Status in Debug form; keep it short.
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}: {}", s.code, s.reason, s.message),
        other => other.to_string(),
    }
}

fn forbidden_hint(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) if s.code == 403 && s.message.contains("exceeded quota") => {
            " (a ResourceQuota is full: raise it; fabricgate-fabriccheck-results to at least the \
             GPU nodes checked at once)"
        }
        kube::Error::Api(s) if s.code == 403 => {
            " (RBAC: the agent needs nodes get/patch, nodes/status patch, events create/patch)"
        }
        _ => "",
    }
}

fn object_hint(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) if s.code == 403 => {
            " (RBAC: compare the ServiceAccount's Role and ClusterRole with the shipped manifest)"
        }
        kube::Error::Api(s) if s.code == 404 => {
            " (not found: is the CRD installed, and the object still there?)"
        }
        _ => "",
    }
}

impl Error {
    /// A parse error of the requirements text, now naming the file (or variable) it came from;
    /// any other error as it is.
    #[must_use]
    pub fn in_config_file(self, path: &std::path::Path) -> Self {
        match self {
            Self::ConfigParse { message, .. } => Self::ConfigParse {
                path: path.to_owned(),
                message,
            },
            other => other,
        }
    }

    /// Bounded, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::ConfigRead { .. } | Self::ConfigParse { .. } | Self::ConfigValue { .. } => {
                "config"
            }
            Self::Usage { .. } => "usage",
            Self::KubeConfig { .. } => "kubeconfig",
            Self::NodeNotFound { .. } => "node_not_found",
            Self::Kube { source, .. } | Self::KubeObject { source, .. } => match source.as_ref() {
                kube::Error::Api(s) if s.code == 429 => "api_throttled",
                kube::Error::Api(s) if s.code == 409 || s.code == 422 => "api_conflict",
                kube::Error::Api(s) if s.code >= 500 => "api_server_error",
                kube::Error::Api(_) => "api_rejected",
                _ => "api_unreachable",
            },
            Self::Conflict { .. } => "api_conflict",
            Self::Internal { .. } => "internal",
            Self::Io { .. } => "io",
        }
    }

    /// The server's requested delay before retrying (`Retry-After` of a 429 body), if any.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::Kube { source, .. } => match source.as_ref() {
                kube::Error::Api(s) if s.code == 429 => s
                    .details
                    .as_ref()
                    .map(|d| d.retry_after_seconds)
                    .filter(|&secs| secs > 0)
                    .map(|secs| std::time::Duration::from_secs(u64::from(secs))),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether the API server answered 429 Too Many Requests.
    pub fn is_throttled(&self) -> bool {
        matches!(self, Self::Kube { source, .. }
            if matches!(source.as_ref(), kube::Error::Api(s) if s.code == 429))
    }

    /// Process exit code for `fabricgate check` and friends (docs/configuration.md, Exit codes).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::ConfigRead { .. }
            | Self::ConfigParse { .. }
            | Self::ConfigValue { .. }
            | Self::Usage { .. }
            | Self::KubeConfig { .. }
            | Self::NodeNotFound { .. }
            | Self::Io { .. } => EXIT_USAGE,
            Self::Kube { .. }
            | Self::KubeObject { .. }
            | Self::Conflict { .. }
            | Self::Internal { .. } => EXIT_CANNOT_PROBE,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
