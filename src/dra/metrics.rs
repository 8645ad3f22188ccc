//! DRA's metric families (`fabricgate_dra_*`, docs/metrics.md): registered among the agent's
//! cached families ([`Metrics::with_families`]) and changed under the metrics' lock
//! ([`Metrics::changing`]).

use super::assess::{self, DraView, InUseHca};
use super::settings::DraSettings;
use crate::config::Config;
use crate::observe::metrics::Metrics;
use crate::policy::devices::DeviceTaint;
use fabricgate_probes::ProbeReport;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriverLabels {
    driver: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InUseLabels {
    hca: String,
    claim: String,
}

/// The handles of DRA's families.
#[derive(Debug, Clone, Default)]
pub struct DraMetrics {
    devices_tainted: Family<ReasonLabels, Gauge>,
    driver_up: Family<DriverLabels, Gauge>,
    device_in_use: Family<InUseLabels, Gauge>,
    rules_writable: Gauge,
}

impl DraMetrics {
    /// Register the families in `r`; `fabricgate_dra_device_rules_writable` only with DRA
    /// drivers configured (a 0 on a device-plugin cluster would read as a refusal).
    pub fn register(r: &mut Registry, dra: &DraSettings) -> Self {
        let m = Self::default();
        r.register(
            "fabricgate_dra_devices_tainted",
            "DRA devices of this node's bad HCAs under a fabricgate DeviceTaintRule, by reason (kubernetes.dra)",
            m.devices_tainted.clone(),
        );
        r.register(
            "fabricgate_dra_driver_up",
            "1 when the DRA driver's kubelet plugin is registered and it publishes this node's ResourceSlices, else 0",
            m.driver_up.clone(),
        );
        r.register(
            "fabricgate_dra_device_in_use",
            "1 for each HCA a pod's ResourceClaim holds that the node's own probe does not see (moved into the pod's network namespace), by HCA and claim",
            m.device_in_use.clone(),
        );
        if dra.enabled() {
            r.register(
                "fabricgate_dra_device_rules_writable",
                "1 when the agent can write its DeviceTaintRules, 0 when the API server does not serve them or refuses the agent",
                m.rules_writable.clone(),
            );
        }
        m
    }

    /// One judgment's figures: each driver's state and the HCAs pods' claims hold, as `seen`
    /// made of `report` for the Judge, and the device taints the Judge keeps (`tainted`).
    pub fn record(
        &self,
        metrics: &Metrics,
        report: &ProbeReport,
        seen: &DraView,
        tainted: &[DeviceTaint],
        config: &Config,
    ) {
        let facts = seen.facts.as_ref();
        let drivers = assess::drivers_up(report, facts, &seen.settings);
        let in_use = &seen.first_assessment(report, config).in_use;
        self.set(metrics, &drivers, in_use, tainted);
    }

    /// Each configured driver (registered and publishing this node's slices, or not), the
    /// HCAs pods' claims hold out of the node's view, the device taints in force.
    pub fn set(
        &self,
        metrics: &Metrics,
        drivers: &[(String, bool)],
        in_use: &[InUseHca],
        tainted: &[DeviceTaint],
    ) {
        metrics.changing(|| {
            self.driver_up.clear();
            for (driver, up) in drivers {
                let labels = DriverLabels {
                    driver: driver.clone(),
                };
                self.driver_up.get_or_create(&labels).set(i64::from(*up));
            }
            self.device_in_use.clear();
            for hca in in_use {
                let labels = InUseLabels {
                    hca: hca.hca.clone(),
                    claim: hca.claim.clone(),
                };
                self.device_in_use.get_or_create(&labels).set(1);
            }
            self.devices_tainted.clear();
            for t in tainted {
                let labels = ReasonLabels {
                    reason: t.reason.clone(),
                };
                self.devices_tainted.get_or_create(&labels).inc();
            }
        });
    }

    /// Whether this node's DeviceTaintRules can be written ([`super::assess::RulesState::On`]).
    pub fn set_rules_writable(&self, metrics: &Metrics, writable: bool) {
        metrics.changing(|| self.rules_writable.set(i64::from(writable)));
    }
}
