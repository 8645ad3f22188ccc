//! Cluster-level safety: the guard (a Deployment that taints nodes whose agent is gone).

pub mod guard;
