//! Shared storage: the mount table, hang-proof statfs, Lustre client health.
//! (Filled in by the storage probe work; this is the seam the rest of the code uses.)

use crate::Roots;
use serde::Serialize;

/// What storage must be probed (derived from the requirements file).
#[derive(Debug, Clone, Default)]
pub struct StorageConfig {}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StorageReport {}

/// Keeps the statfs workers alive across probes.
#[derive(Debug)]
pub struct StorageProber {
    #[allow(dead_code)]
    config: StorageConfig,
}

impl StorageProber {
    pub fn new(config: StorageConfig) -> Self {
        Self { config }
    }

    pub fn probe(&mut self, _roots: &Roots) -> StorageReport {
        StorageReport::default()
    }
}
