//! DRA, the whole feature in one place (docs/dra.md): the HCAs a DRA driver publishes in this
//! node's ResourceSlices, matched to the HCAs the probe judged. A driver gone or an HCA not
//! published is a finding on the node's RDMA part; a published HCA the probe finds bad gets a
//! `DeviceTaintRule`, kept with the same hysteresis as the Node's taint; an HCA a pod's claim
//! holds out of the node's view serves that pod and is not the node's to count. The config key
//! is `kubernetes.dra`.
//!
//! Its floors, lowest first (each uses only those below it, and the crate's floors at or below
//! its own, as `tests/repo/boundaries.rs` checks):
//! - `settings`: the `kubernetes.dra` section, read through `FeatureSection` (the config
//!   floor);
//! - `assess`: what the slices and claims make of a probe, handed to the Judge as a
//!   [`crate::policy::devices::DeviceView`] ([`assess::DraView`]), which alone decides (the
//!   policy floor);
//! - `metrics`: `fabricgate_dra_*` (the observe floor);
//! - `common`, `slices`, `claims`, `in_pods`, `registration`, `rules`, `jobs`: the I/O: this
//!   node's slices in, the claims of its pods and what their namespaces hold, each driver's
//!   kubelet plugin followed through its registration socket, the rules of its bad HCAs out,
//!   and the jobs the agent starts (the node floor).

pub mod assess;
pub mod claims;
pub mod common;
pub mod in_pods;
pub mod jobs;
pub mod metrics;
pub mod registration;
pub mod rules;
pub mod settings;
pub mod slices;
