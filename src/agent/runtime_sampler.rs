//! Where the runtime task's facts come from: the [`Sampler`] trait, the probes' `PodSampler`
//! behind it in production, and the test seam.
//!
//! TEST SEAM, never set in a deployment: `FABRICGATE_TEST_POD_FACTS=<file>` makes the runtime
//! task read each window's facts from a file instead of the kernel, so the cluster tests can
//! show a pod on sockets to the shipped agent without real traffic (tests/cluster/
//! runtime_transport.rs). One line per pod: `<uid> sockets <bytes> <peer-ip> <interface>` or
//! `<uid> rdma <device>` (one RC QP in RTS on port 1 of the device); a line that does not
//! read is skipped. Everything after the sampler (judging, metrics, writes) is the real path.

use fabricgate_probes::runtime::restrack::{QpEntry, QpOwner, QpState, QpType};
use fabricgate_probes::runtime::sample::{PodSampler, SampleRequest};
use fabricgate_probes::runtime::{InternodeTcp, Observed, PodTransportFacts};
use std::path::PathBuf;
use std::time::Duration;

/// Where the facts come from: the probes' [`PodSampler`] in production; a test gives its own.
pub trait Sampler: Send + 'static {
    fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts>;
}

impl Sampler for PodSampler {
    fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
        PodSampler::sample(self, request)
    }
}

pub const ENV: &str = "FABRICGATE_TEST_POD_FACTS";

pub struct FileFacts {
    pub path: PathBuf,
    pub window: Duration,
}

impl Sampler for FileFacts {
    fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .filter_map(|l| self.line(l))
            .filter(|f| {
                request
                    .pod_uids
                    .as_ref()
                    .is_none_or(|u| u.contains(&f.pod_uid))
            })
            .collect()
    }
}

impl FileFacts {
    fn line(&self, line: &str) -> Option<PodTransportFacts> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let (qps, tcp) = match w.as_slice() {
            [_, "sockets", bytes, peer, interface] => (
                Vec::new(),
                InternodeTcp {
                    bytes: bytes.parse().ok()?,
                    window: self.window,
                    peers: vec![peer.parse().ok()?],
                    interfaces: vec![(*interface).to_owned()],
                },
            ),
            [_, "rdma", device] => (
                vec![QpEntry {
                    device_index: 0,
                    device: (*device).to_owned(),
                    port: Some(1),
                    lqpn: 17,
                    rqpn: Some(18),
                    qp_type: QpType::Rc,
                    state: QpState::Rts,
                    owner: QpOwner::Pid(1),
                    pdn: None,
                }],
                InternodeTcp {
                    window: self.window,
                    ..InternodeTcp::default()
                },
            ),
            _ => return None,
        };
        Some(PodTransportFacts {
            pod_uid: w.first()?.to_string(),
            qps: Observed::Seen(qps),
            internode_tcp: Observed::Seen(tcp),
        })
    }
}
