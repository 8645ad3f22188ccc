//! `fabricgate_netdev_{receive,transmit}_bytes_total{device}`, reset-proof, the series of an
//! interface gone for longer than `--stale-series-grace` dropped.

use crate::observe::counters::{Monotonic, accumulate, drop_series, expire};
use crate::observe::metrics::CheckMetrics;
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::netdev;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::{Registry, Unit};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Debug)]
pub struct NetdevMetrics {
    rx_bytes: Family<DeviceLabels, Counter>,
    tx_bytes: Family<DeviceLabels, Counter>,
    readers: Mutex<Readers>,
}

/// The last raw value of each counter series, and when each interface was last seen.
#[derive(Debug, Default)]
struct Readers {
    rx: HashMap<DeviceLabels, Monotonic>,
    tx: HashMap<DeviceLabels, Monotonic>,
    seen: HashMap<String, Instant>,
}

impl NetdevMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            rx_bytes: Family::default(),
            tx_bytes: Family::default(),
            readers: Mutex::default(),
        };
        registry.register_with_unit(
            "fabricgate_netdev_receive",
            "Bytes received on the TCP path of the interface (statistics/rx_bytes)",
            Unit::Bytes,
            metrics.rx_bytes.clone(),
        );
        registry.register_with_unit(
            "fabricgate_netdev_transmit",
            "Bytes sent on the TCP path of the interface (statistics/tx_bytes)",
            Unit::Bytes,
            metrics.tx_bytes.clone(),
        );
        metrics
    }
}

impl CheckMetrics for NetdevMetrics {
    fn record(&self, report: &ProbeReport, _verdict: &Verdict, grace: Duration) {
        // Recorded under the metrics' own lock; this one is never contended.
        let mut st = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *st;
        let netdevs = netdev::reports(report);
        for nd in netdevs {
            let l = DeviceLabels {
                device: nd.name.clone(),
            };
            if let Some(b) = nd.rx_bytes {
                accumulate(&self.rx_bytes, &mut st.rx, l.clone(), b);
            }
            if let Some(b) = nd.tx_bytes {
                accumulate(&self.tx_bytes, &mut st.tx, l, b);
            }
        }
        let present = netdevs.iter().map(|n| n.name.clone());
        let gone = expire(&mut st.seen, present, Instant::now(), grace);
        if !gone.is_empty() {
            let dev_gone = |l: &DeviceLabels| gone.contains(&l.device);
            drop_series(&self.rx_bytes, &mut st.rx, dev_gone);
            drop_series(&self.tx_bytes, &mut st.tx, dev_gone);
        }
    }
}
