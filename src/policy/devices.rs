//! How the cluster sees this node's HCAs, judged beside the probe. A feature that hands them to
//! pods (the device plugins, DRA's ResourceSlices: docs/dra.md) gives the
//! [`super::judge::Judge`] a [`DeviceView`]; the Judge folds its [`DeviceAssessment`] into the RDMA part (its findings,
//! its warnings, the ports pods hold out of the node's count, the agent's own trouble) and
//! keeps the marks of single devices ([`DeviceTaint`]) with their own hysteresis. The Judge
//! stays the one decider: a view says what it sees, never what the node's verdict is.

use super::Finding;
use crate::config::Config;
use fabricgate_probes::ProbeReport;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;

/// One bad HCA as the taint its published device gets.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct DeviceTaint {
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// The HCA (`mlx5_3`).
    pub hca: String,
    /// The first problem's code (`PortDown`): the taint's value.
    pub reason: String,
    pub message: String,
}

/// What a [`DeviceView`] makes of one probe.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceAssessment {
    /// Findings on the RDMA part: the node is not ready (a driver gone, an HCA not published).
    pub findings: Vec<Finding>,
    /// Facts on the RDMA part that block nothing.
    pub warnings: Vec<Finding>,
    /// The agent cannot look (a directory not mounted into its container): an agent fault.
    pub own_problems: Vec<String>,
    /// Ports of HCAs pods hold out of the node's view: they serve those pods, and the node is
    /// judged on the rest (`rdma.min_active_ports` lowered by as many).
    pub ports_in_use: u32,
    /// The published devices of the HCAs the probe finds bad, before the hysteresis.
    pub taints: Vec<DeviceTaint>,
    /// Device nodes missing in the agent's container are this view's finding (a plugin handed
    /// out an incomplete set): the verbs probe's "cannot open" for them is then not the
    /// agent's `NoDeviceAccess` fault.
    pub explains_missing_devices: bool,
}

/// What a feature outside the probe sees of this node's HCAs, at one moment.
pub trait DeviceView: Debug + Send + Sync {
    /// Judge one probe (a full one, or the last one with a kernel event's port states).
    fn assess(&self, report: &ProbeReport, config: &Config) -> DeviceAssessment;

    /// The device taints in force (after the hysteresis) cannot be applied: with `taints` to
    /// apply, a finding (the Node is tainted instead); without, a warning. `None`: they can.
    fn taints_refused(&self, taints: &[DeviceTaint]) -> Option<Finding>;
}

/// Every view's assessment of one probe, together, in the order of `views`.
pub fn assess_all(
    views: &[Arc<dyn DeviceView>],
    report: &ProbeReport,
    config: &Config,
) -> DeviceAssessment {
    let mut all = DeviceAssessment::default();
    for view in views {
        let one = view.assess(report, config);
        all.findings.extend(one.findings);
        all.warnings.extend(one.warnings);
        all.own_problems.extend(one.own_problems);
        all.ports_in_use = all.ports_in_use.saturating_add(one.ports_in_use);
        all.taints.extend(one.taints);
        all.explains_missing_devices |= one.explains_missing_devices;
    }
    all
}

/// The first view that cannot apply the device taints in force says so.
pub fn taints_refused(views: &[Arc<dyn DeviceView>], taints: &[DeviceTaint]) -> Option<Finding> {
    views.iter().find_map(|v| v.taints_refused(taints))
}

/// The device taints in force: a bad device is tainted at once; a tainted one is untainted
/// only after `node.recover_after` full probes in a row without it (as the Node's taint).
#[derive(Debug, Clone, Default)]
pub struct DeviceHysteresis {
    /// Tainted devices by (driver, pool, device), with the good probes seen since.
    tainted: BTreeMap<(String, String, String), (DeviceTaint, u32)>,
}

impl DeviceHysteresis {
    /// A full probe's bad devices.
    pub fn apply(&mut self, bad: &[DeviceTaint], recover_after: u32) -> Vec<DeviceTaint> {
        let now: BTreeMap<_, _> = bad.iter().map(|t| (key(t), t)).collect();
        self.tainted.retain(|k, (_, good)| {
            if now.contains_key(k) {
                return true;
            }
            *good += 1;
            *good < recover_after.max(1)
        });
        for (k, t) in now {
            self.tainted.insert(k, (t.clone(), 0));
        }
        self.current()
    }

    /// Bad devices seen between full probes (a kernel event): tainted at once, nothing
    /// untainted.
    pub fn add(&mut self, bad: &[DeviceTaint]) -> Vec<DeviceTaint> {
        for t in bad {
            self.tainted.insert(key(t), (t.clone(), 0));
        }
        self.current()
    }

    pub fn current(&self) -> Vec<DeviceTaint> {
        self.tainted.values().map(|(t, _)| t.clone()).collect()
    }
}

fn key(t: &DeviceTaint) -> (String, String, String) {
    (t.driver.clone(), t.pool.clone(), t.device.clone())
}
