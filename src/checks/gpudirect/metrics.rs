//! `fabricgate_gpudirect_*` and the RDMA ports' transport settings the GPUDirect probe reads
//! (`fabricgate_rdma_port_active_mtu`, `fabricgate_rdma_port_ecn_enabled`).

use super::NAME;
use crate::config::Config;
use crate::observe::metrics::{CheckMetrics, OptionalGauge, set_optional};
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::gpudirect;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::collections::BTreeSet;
use std::time::Duration;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuPairLabels {
    gpu: String,
    hca: String,
    relation: &'static str,
    numa: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    device: String,
    port: u32,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EcnLabels {
    device: String,
    port: u32,
    /// `np` (notification point) or `rp` (reaction point).
    point: &'static str,
}

#[derive(Debug)]
pub struct GpudirectMetrics {
    ready: Gauge,
    gpus: Gauge,
    pair_relation: Family<GpuPairLabels, Gauge>,
    worst_relation: OptionalGauge,
    acs_redirect_bridges: Gauge,
    peer_memory: Gauge,
    port_active_mtu: Family<PortLabels, Gauge>,
    port_ecn_enabled: Family<EcnLabels, Gauge>,
    /// `rdma.roce.ecn_priority`: the priority `fabricgate_rdma_port_ecn_enabled` reports.
    ecn_priority: u8,
}

impl GpudirectMetrics {
    pub fn register(registry: &mut Registry, config: &Config) -> Self {
        let m = Self {
            ready: Gauge::default(),
            gpus: Gauge::default(),
            pair_relation: Family::default(),
            worst_relation: OptionalGauge::default(),
            acs_redirect_bridges: Gauge::default(),
            peer_memory: Gauge::default(),
            port_active_mtu: Family::default(),
            port_ecn_enabled: Family::default(),
            ecn_priority: config.rdma.roce.ecn_priority,
        };
        let r = registry;
        r.register(
            "fabricgate_gpudirect_ready",
            "1 when the GPUDirect checks pass (or do not apply: no GPUs and not required), else 0",
            m.ready.clone(),
        );
        r.register(
            "fabricgate_gpudirect_gpus",
            "NVIDIA GPUs found in sysfs (PCI vendor 0x10de, display/3D class)",
            m.gpus.clone(),
        );
        r.register(
            "fabricgate_gpudirect_pair_relation",
            "PCIe relation between each GPU and its nearest HCA: 0 PIX, 1 PXB, 2 PHB, 3 NODE, 4 SYS",
            m.pair_relation.clone(),
        );
        r.register(
            "fabricgate_gpudirect_worst_relation",
            "Worst GPU-HCA relation on the node: 0 PIX, 1 PXB, 2 PHB, 3 NODE, 4 SYS (absent without pairs)",
            m.worst_relation.clone(),
        );
        r.register(
            "fabricgate_gpudirect_acs_redirect_bridges",
            "Bridges on GPU-HCA paths with ACS request or completion redirection enabled",
            m.acs_redirect_bridges.clone(),
        );
        r.register(
            "fabricgate_gpudirect_peer_memory",
            "1 when GPU memory can be registered with the HCA (nvidia_peermem loaded, or DMA-BUF), else 0",
            m.peer_memory.clone(),
        );
        r.register_with_unit(
            "fabricgate_rdma_port_active_mtu",
            "Active RDMA MTU of the port (verbs; RoCE with --verbs off: derived from the netdev MTU)",
            Unit::Bytes,
            m.port_active_mtu.clone(),
        );
        r.register(
            "fabricgate_rdma_port_ecn_enabled",
            "1 when ECN is on for rdma.roce.ecn_priority at the notification (np) or reaction (rp) point",
            m.port_ecn_enabled.clone(),
        );
        m
    }
}

impl CheckMetrics for GpudirectMetrics {
    fn record(&self, report: &ProbeReport, verdict: &Verdict, _grace: Duration) {
        // No part (the collector did not run): nothing to hold against the node.
        let ready = verdict.checks.get(NAME).is_none_or(|c| c.part.ready);
        self.ready.set(i64::from(ready));
        self.pair_relation.clear();
        self.port_active_mtu.clear();
        self.port_ecn_enabled.clear();
        let Some(gd) = gpudirect::of(report) else {
            self.gpus.set(0);
            set_optional(&self.worst_relation, None);
            self.acs_redirect_bridges.set(0);
            self.peer_memory.set(0);
            return;
        };
        self.gpus
            .set(i64::try_from(gd.gpus.len()).unwrap_or(i64::MAX));
        for p in &gd.pairs {
            self.pair_relation
                .get_or_create(&GpuPairLabels {
                    gpu: p.gpu.clone(),
                    hca: p.hca.clone(),
                    relation: p.relation.name(),
                    numa: p.numa.map_or(String::new(), |n| n.to_string()),
                })
                .set(i64::from(p.relation.rank()));
        }
        set_optional(
            &self.worst_relation,
            gd.worst_relation.map(|r| f64::from(r.rank())),
        );
        let redirecting: BTreeSet<&str> = gd
            .pairs
            .iter()
            .flat_map(|p| p.redirecting_bridges())
            .map(|b| b.address.as_str())
            .collect();
        self.acs_redirect_bridges
            .set(i64::try_from(redirecting.len()).unwrap_or(i64::MAX));
        self.peer_memory.set(i64::from(gd.peermem.usable()));
        for t in &gd.transport {
            if let Some(mtu) = t.active_mtu {
                self.port_active_mtu
                    .get_or_create(&PortLabels {
                        device: t.device.clone(),
                        port: t.port,
                    })
                    .set(i64::from(mtu));
            }
            let Some(ecn) = &t.ecn else { continue };
            for (point, map) in [("np", &ecn.np), ("rp", &ecn.rp)] {
                if let Some(on) = map.get(&self.ecn_priority) {
                    self.port_ecn_enabled
                        .get_or_create(&EcnLabels {
                            device: t.device.clone(),
                            port: t.port,
                            point,
                        })
                        .set(i64::from(*on));
                }
            }
        }
    }
}
