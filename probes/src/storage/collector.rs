//! The storage probe as the prober's collector: its fact in the report (`storage`) and how the
//! agent reads it back.

use super::{MountStatus, StorageProber, StorageReport};
use crate::collect::{Collector, Pass};
use crate::fact::Fact;
use crate::report::ProbeReport;

/// The collector's name and its key in the report: `storage`, its `probe` label and timing.
pub const NAME: &str = "storage";

/// What this probe found of the mounts and the Lustre client, when the storage collector ran.
pub fn of(report: &ProbeReport) -> Option<&StorageReport> {
    report.facts.get(NAME)
}

/// Put `storage` in `report` as the collector would have (a report built or changed in code).
pub fn set(report: &mut ProbeReport, storage: StorageReport) {
    report.facts.insert(NAME, fact(storage).from_probe(NAME));
}

/// The fact of one probe: the report, and as the probe's errors the problems not tied to one
/// mount, the Lustre client's, and those of mounts whose statfs failed.
fn fact(storage: StorageReport) -> Fact {
    let mut errors = storage.errors.clone();
    errors.extend(storage.client.errors.iter().cloned());
    errors.extend(
        storage
            .mounts
            .iter()
            .filter(|m| m.status == MountStatus::Error)
            .map(|m| m.message.clone()),
    );
    Fact::new(storage).with_errors(errors)
}

impl Collector for StorageProber {
    fn name(&self) -> &'static str {
        NAME
    }

    fn collect(&mut self, pass: &Pass<'_>) -> Fact {
        fact(self.probe(pass.roots))
    }
}
