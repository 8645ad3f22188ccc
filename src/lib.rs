//! fabricgate: proves a GPU node's RDMA fabric and shared storage work before training
//! workers may land on it. The binary in `main.rs` is a thin CLI over this library.

#![forbid(unsafe_code)]

pub mod agent;
pub mod checks;
pub mod cli;
pub mod cluster;
pub mod command;
pub mod config;
pub mod device_plugin;
pub mod dra;
pub mod error;
pub mod gang;
pub mod harness;
pub mod node;
pub mod observe;
pub mod peers;
pub mod pod;
pub mod policy;
pub mod text;
pub mod transport;

pub use error::{
    EXIT_AGENT_PANIC, EXIT_CANNOT_PROBE, EXIT_NOT_VALIDATED, EXIT_USAGE, EXIT_VALIDATED, Error,
    Result,
};
