//! Device-plugin liveness, the whole feature in one place (docs/failure-modes.md): the kubelet's
//! device plugins that hand RDMA devices to pods, alive or not. Three signs, each a
//! `DevicePluginUnavailable` finding on the node's RDMA part: the watched Node's resources
//! (`kubernetes.rdma_resources`: in capacity, allocatable > 0; a kubelet restart held back for
//! `kubernetes.plugin_grace`), the plugins' sockets (`kubernetes.device_plugin_sockets`) and an
//! incomplete set of device nodes handed to the agent's own container (both read by the
//! probe's host check, `probes/src/host.rs`).
//!
//! Its floors, lowest first (each uses only those below it, and the crate's floors at or below
//! its own, as `tests/repo/boundaries.rs` checks):
//! - `assess`: what the Node and the host report make of the plugins, handed to the Judge as a
//!   [`crate::policy::devices::DeviceView`] ([`assess::PluginView`]), which alone decides (the
//!   policy floor);
//! - `node_checks`: the agent's side, each watched version of its Node turned into findings
//!   (the agent floor).

pub mod assess;
pub mod node_checks;
