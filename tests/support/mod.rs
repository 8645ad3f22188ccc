//! Shared test support: a real control plane (etcd, kube-apiserver, kube-scheduler), a
//! fault-injecting proxy in front of it, small sysfs fixture trees, and a test PKI for the
//! admission webhook over TLS. Each integration test binary uses a different part of it.
//! Binaries that use it also declare `mod common;` (CI and tool checks).
#![allow(dead_code)]

pub mod controlplane;
pub mod faultproxy;
pub mod sysfs;
pub mod tls;
