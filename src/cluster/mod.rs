//! Cluster-level controllers: the guard (a Deployment that taints nodes whose agent is gone)
//! and the Kueue admission check (a gang's nodes validated and tested together).

pub mod admission_check;
pub mod guard;
pub mod lease;

/// Objects per page of the controllers' lists (each page is deserialized whole before its
/// objects are slimmed for the cache).
pub(crate) const LIST_PAGE: u32 = 500;
