//! Cluster-level controllers: the guard (a Deployment that taints nodes whose agent is gone)
//! and the Kueue admission check (a gang's nodes validated and tested together).

pub mod admission_check;
pub mod guard;
pub mod lease;
