//! The gang pre-flight, the whole feature in one place (docs/gangs.md): before Kueue admits a
//! distributed job, `fabricgate admission-check` asks the agents of the nodes it would land on
//! to test their RDMA paths to each other in a ring, and admits only when every pair passed;
//! once running, a gang whose pod falls back to sockets is requeued. The config key is
//! `gang:`; the wire both ends speak is the peers' (`probes::rdma::peer`), shared with the
//! peer mesh.
//!
//! Its floors, lowest first (each uses only those below it, and the crate's floors at or below
//! its own, as `tests/repo/boundaries.rs` checks):
//! - `settings`: the `gang:` section (the config floor);
//! - `fabriccheck`: the two resources the admission check and the agents share (`FabricCheck`,
//!   `FabricCheckResult`), their names and annotations (the node floor);
//! - `ring`: the agent's side, its part of a check's ring measured and reported (the agent
//!   floor);
//! - `admission_check`: the controller, `fabricgate admission-check` (the cluster floor).

pub mod admission_check;
pub mod fabriccheck;
pub mod ring;
pub mod settings;
