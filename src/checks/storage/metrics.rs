//! `fabricgate_lustre_ready` and the mounts' series (`fabricgate_mount_*`), the mounts'
//! gauges cleared on each probe: an unmounted path disappears.

use super::CHECK;
use crate::observe::metrics::{CheckMetrics, GaugeF64};
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::storage::{self, MountStatus, StorageReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::time::Duration;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MountLabels {
    mount: String,
}

#[derive(Debug, Default)]
pub struct StorageMetrics {
    lustre_ready: Gauge,
    mount_up: Family<MountLabels, Gauge>,
    mount_hung: Family<MountLabels, Gauge>,
    mount_statfs_seconds: Family<MountLabels, GaugeF64>,
    mount_free_bytes: Family<MountLabels, Gauge>,
    mount_available_bytes: Family<MountLabels, Gauge>,
    mount_free_inodes: Family<MountLabels, Gauge>,
}

impl StorageMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register(
            "fabricgate_lustre_ready",
            "1 when every required mount is healthy, else 0",
            m.lustre_ready.clone(),
        );
        r.register(
            "fabricgate_mount_up",
            "1 when the mount is present and statfs answered, else 0",
            m.mount_up.clone(),
        );
        r.register(
            "fabricgate_mount_hung",
            "1 when statfs on the mount did not return in time, else 0",
            m.mount_hung.clone(),
        );
        r.register_with_unit(
            "fabricgate_mount_statfs",
            "How long statfs on the mount took",
            Unit::Seconds,
            m.mount_statfs_seconds.clone(),
        );
        r.register_with_unit(
            "fabricgate_mount_free",
            "Free bytes on the mount",
            Unit::Bytes,
            m.mount_free_bytes.clone(),
        );
        r.register_with_unit(
            "fabricgate_mount_available",
            "Bytes available to unprivileged users on the mount",
            Unit::Bytes,
            m.mount_available_bytes.clone(),
        );
        r.register(
            "fabricgate_mount_free_inodes",
            "Free inodes on the mount",
            m.mount_free_inodes.clone(),
        );
        m
    }
}

impl CheckMetrics for StorageMetrics {
    fn record(&self, report: &ProbeReport, verdict: &Verdict, _grace: Duration) {
        let ready = verdict.checks.get(CHECK).is_none_or(|c| c.part.ready);
        self.lustre_ready.set(i64::from(ready));
        for fam in [
            &self.mount_up,
            &self.mount_hung,
            &self.mount_free_bytes,
            &self.mount_available_bytes,
            &self.mount_free_inodes,
        ] {
            fam.clear();
        }
        self.mount_statfs_seconds.clear();
        let Some(storage) = storage::of(report) else {
            return;
        };
        let as_gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for m in mount_samples(storage) {
            let l = MountLabels { mount: m.mount };
            self.mount_up.get_or_create(&l).set(i64::from(m.up));
            self.mount_hung.get_or_create(&l).set(i64::from(m.hung));
            if let Some(s) = m.statfs_seconds {
                self.mount_statfs_seconds.get_or_create(&l).set(s);
            }
            for (family, value) in [
                (&self.mount_free_bytes, m.free_bytes),
                (&self.mount_available_bytes, m.available_bytes),
                (&self.mount_free_inodes, m.free_inodes),
            ] {
                if let Some(v) = value {
                    family.get_or_create(&l).set(as_gauge(v));
                }
            }
        }
    }
}

/// What the metrics need of one checked mount.
#[derive(Debug, Clone, PartialEq)]
struct MountSample {
    mount: String,
    up: bool,
    hung: bool,
    statfs_seconds: Option<f64>,
    free_bytes: Option<u64>,
    available_bytes: Option<u64>,
    free_inodes: Option<u64>,
}

/// The per-mount figures of a storage report.
fn mount_samples(report: &StorageReport) -> Vec<MountSample> {
    report
        .mounts
        .iter()
        .map(|m| {
            let capacity = m.capacity.as_ref();
            MountSample {
                mount: m.path.clone(),
                up: !matches!(
                    m.status,
                    MountStatus::Missing | MountStatus::Hung | MountStatus::Error
                ),
                hung: m.status == MountStatus::Hung,
                statfs_seconds: m.statfs_seconds,
                free_bytes: capacity.map(|c| c.free_bytes),
                available_bytes: capacity.map(|c| c.available_bytes),
                free_inodes: capacity.and_then(|c| c.free_inodes),
            }
        })
        .collect()
}
