//! Shared test support: a real control plane (etcd, kube-apiserver, kube-scheduler), a
//! fault-injecting proxy in front of it, and small sysfs fixture trees. Each integration test
//! binary uses a different part of it.
#![allow(dead_code)]

pub mod controlplane;
pub mod env;
pub mod faultproxy;
pub mod sysfs;
