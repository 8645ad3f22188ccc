//! Where the runtime task's facts come from: the [`Sampler`] trait, the probes' `PodSampler`
//! behind it in production, and the test seam.
//!
//! TEST SEAM, compiled only into a test build (the `test-seams` feature, which the package's
//! dev-dependency on itself turns on for `cargo test`; the image and `cargo build` never have
//! it): `FABRICGATE_TEST_POD_FACTS=<file>` makes the runtime task read each window's facts from
//! a file instead of the kernel, so the cluster tests can show a pod on sockets to the agent
//! without real traffic (tests/cluster/runtime_transport.rs). One line per pod: `<uid> sockets <bytes> <peer-ip> <interface>` or
//! `<uid> rdma <device>` (one RC QP in RTS on port 1 of the device); a line that does not
//! read is skipped. Everything after the sampler (judging, metrics, writes) is the real path.

use fabricgate_probes::transport::PodTransportFacts;
use fabricgate_probes::transport::sample::{PodSampler, SampleRequest};

/// Where the facts come from: the probes' [`PodSampler`] in production; a test gives its own.
pub trait Sampler: Send + 'static {
    fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts>;
}

impl Sampler for PodSampler {
    fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
        PodSampler::sample(self, request)
    }
}

/// The test seam's sampler when this build has it and the variable is set; `None` otherwise
/// (always, in a shipped build).
#[cfg(feature = "test-seams")]
pub fn from_env(window: std::time::Duration) -> Option<Box<dyn Sampler>> {
    let path = std::env::var_os("FABRICGATE_TEST_POD_FACTS")?;
    Some(Box::new(seam::FileFacts {
        path: path.into(),
        window,
    }))
}

#[cfg(not(feature = "test-seams"))]
pub fn from_env(_window: std::time::Duration) -> Option<Box<dyn Sampler>> {
    None
}

#[cfg(feature = "test-seams")]
mod seam {
    use super::Sampler;
    use fabricgate_probes::transport::restrack::{QpEntry, QpOwner, QpState, QpType};
    use fabricgate_probes::transport::sample::SampleRequest;
    use fabricgate_probes::transport::{InternodeTcp, Observed, PodTransportFacts};
    use std::path::PathBuf;
    use std::time::Duration;

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
                        other_bytes: 0,
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
                ports: Vec::new(),
            })
        }
    }
}
