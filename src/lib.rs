//! fabricgate: proves a GPU node's RDMA fabric and shared storage work before training
//! workers may land on it. The binary in `main.rs` is a thin CLI over this library.

#![forbid(unsafe_code)]

pub mod agent;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod error;
pub mod node;
pub mod observe;
pub mod peers;
pub mod pod;
pub mod policy;

pub use error::{Error, Result};

/// `fabricgate check` exit codes (docs/configuration.md, Exit codes).
pub const EXIT_VALIDATED: u8 = 0;
pub const EXIT_NOT_VALIDATED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_CANNOT_PROBE: u8 = 3;
/// `fabricgate run`: a task of the agent panicked; the process ends so the kubelet restarts it
/// (docs/hardening.md).
pub const EXIT_AGENT_PANIC: u8 = 70;
