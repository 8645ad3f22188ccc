//! The probes over hostile trees: bounded reads of odd files, garbage in sysfs, and
//! configuration parsing under proptest.

mod common;

#[path = "probe/config_proptest.rs"]
mod config_proptest;
#[path = "probe/garbage_sysfs.rs"]
mod garbage_sysfs;
#[path = "probe/probe_io.rs"]
mod probe_io;
