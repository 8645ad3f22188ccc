//! Shared test support: the API-server stand-in and small sysfs fixture trees.
//! Each integration test binary uses a different part of it.
#![allow(dead_code)]

pub mod apiserver;
pub mod sysfs;
