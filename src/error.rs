//! The agent crate's one error type.

use std::path::PathBuf;

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
}

impl Error {
    /// Bounded, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::ConfigRead { .. } | Self::ConfigParse { .. } | Self::ConfigValue { .. } => {
                "config"
            }
            Self::Usage { .. } => "usage",
        }
    }

    /// Process exit code for `fabricgate check` and friends (DESIGN.md).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::ConfigRead { .. }
            | Self::ConfigParse { .. }
            | Self::ConfigValue { .. }
            | Self::Usage { .. } => crate::EXIT_USAGE,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
