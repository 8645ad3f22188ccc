//! Runtime transport per pod, the whole feature in one place (docs/runtime-transport.md):
//! which training pod is on RDMA and which fell back to TCP sockets, judged by its job's own
//! peers and confirmed before anything acts. The config key stays `runtime:`.
//!
//! Its floors, lowest first (each uses only those below it, and the crate's floors at or below
//! its own, as `tests/repo/boundaries.rs` checks):
//! - `settings`: the `runtime:` section (the config floor);
//! - `bandwidth`, `verdict`, `eviction`: whose bytes each RDMA port carried, the verdict per
//!   pod and its confirmation, the guard's eviction plan (pure; the policy floor);
//! - `metrics`: the `fabricgate_pod_*` families (the observe floor);
//! - `jobs`, `pods`, `peers`, `writer`: a pod's job and addresses, which pods are judged and
//!   what their condition says, the peer watch, the writes (the node floor);
//! - `sampler`, `task`, `check`, `check_peers`: where the facts come from, the agent's task,
//!   `fabricgate check`'s pods section (the agent floor).

pub mod bandwidth;
pub mod check;
pub mod check_peers;
pub mod eviction;
pub mod jobs;
pub mod metrics;
pub mod peers;
pub mod pods;
pub mod sampler;
pub mod settings;
pub mod task;
pub mod verdict;
pub mod writer;
