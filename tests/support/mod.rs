//! Shared test support: the API-server stand-in, small sysfs fixture trees, and a test PKI
//! for the admission webhook over TLS.
//! Each integration test binary uses a different part of it.
#![allow(dead_code)]

pub mod apiserver;
pub mod sysfs;
pub mod tls;
