//! The per-pod runtime transport metrics: `fabricgate_pod_transport` (one-hot),
//! `fabricgate_pod_rdma_qps`, `fabricgate_pod_internode_tcp_bytes_total`,
//! `fabricgate_pod_other_tcp_bytes_total` and
//! `fabricgate_pod_owner_info` (the pod's controller owner, which the per-job alert joins on);
//! per job, `fabricgate_job_rdma_bytes_total` (what the ports that are the job's alone
//! carried) and `fabricgate_rdma_port_jobs` (every job holding data-path QPs on a port: more
//! than one series for a port is a shared port, whose bytes are nobody's).
//! Every series of a pod is removed when the pod stops being judged, every series of a job's
//! port when the job no longer holds it. Registered in the live registry: the runtime task
//! records without the probe loop's state lock.

use crate::transport::bandwidth::PortShare;
use crate::transport::verdict::{PodVerdict, Transport};
use fabricgate_probes::transport::restrack::QpEntry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct PodLabels {
    namespace: String,
    pod: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransportLabels {
    namespace: String,
    pod: String,
    transport: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct QpLabels {
    namespace: String,
    pod: String,
    device: String,
    port: String,
    r#type: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct OwnerLabels {
    namespace: String,
    pod: String,
    owner_kind: String,
    owner_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct JobPortLabels {
    namespace: String,
    job: String,
    device: String,
    port: String,
    direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct PortJobLabels {
    device: String,
    port: String,
    namespace: String,
    job: String,
}

/// One judged pod's sample, as the runtime task hands it over.
#[derive(Debug, Clone)]
pub struct PodSample<'a> {
    pub namespace: &'a str,
    pub pod: &'a str,
    /// The controller owner (`kind`, `name`); `None`: a bare pod (the alert groups it alone).
    pub owner: Option<(&'a str, &'a str)>,
    pub verdict: &'a PodVerdict,
    /// Its QPs (all of them, by device, port and type), when seen.
    pub qps: Option<&'a [QpEntry]>,
}

/// What each pod's series are, to remove exactly those when it goes.
#[derive(Debug, Default)]
struct Known {
    qps: BTreeSet<QpLabels>,
    owner: Option<OwnerLabels>,
}

#[derive(Debug, Default)]
pub struct PodMetrics {
    transport: Family<TransportLabels, Gauge>,
    qps: Family<QpLabels, Gauge>,
    tcp_bytes: Family<PodLabels, Counter>,
    other_tcp_bytes: Family<PodLabels, Counter>,
    owner: Family<OwnerLabels, Gauge>,
    sampler_missed: Counter,
    known: Mutex<BTreeMap<PodLabels, Known>>,
    job_rdma_bytes: Family<JobPortLabels, Counter>,
    port_jobs: Family<PortJobLabels, Gauge>,
    known_ports: Mutex<(BTreeSet<JobPortLabels>, BTreeSet<PortJobLabels>)>,
}

impl PodMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register(
            "fabricgate_pod_transport",
            "The transport a judged pod uses over the last runtime.window (one-hot: rdma, \
             sockets, idle, unknown)",
            m.transport.clone(),
        );
        r.register(
            "fabricgate_pod_rdma_qps",
            "Queue pairs a judged pod's processes hold, by device, port and type",
            m.qps.clone(),
        );
        r.register(
            "fabricgate_pod_internode_tcp_bytes",
            "TCP bytes a judged pod moved with its peers, the pods of its job on other nodes (any \
             interface and network, IPoIB and secondary networks included)",
            m.tcp_bytes.clone(),
        );
        r.register(
            "fabricgate_pod_other_tcp_bytes",
            "TCP bytes a judged pod moved with addresses off its node that are not its job's \
             (object storage, a dataset server, another job's pods): shown, never deciding sockets",
            m.other_tcp_bytes.clone(),
        );
        r.register(
            "fabricgate_pod_owner_info",
            "A judged pod's controller owner (kind and name; none: the pod itself), for \
             grouping the pods of one job",
            m.owner.clone(),
        );
        r.register(
            "fabricgate_job_rdma_bytes",
            "Bytes an RDMA port carried while its data-path queue pairs were all one job's, by \
             job, device, port and direction (port_xmit_data/port_rcv_data x 4, IPoIB \
             subtracted on InfiniBand; rxe: RoCE packets x MTU, an estimate)",
            m.job_rdma_bytes.clone(),
        );
        r.register(
            "fabricgate_rdma_port_jobs",
            "The jobs whose judged pods hold data-path queue pairs on an RDMA port (always 1; a \
             port with several is shared, and its bytes are not counted for any job)",
            m.port_jobs.clone(),
        );
        r.register(
            "fabricgate_pod_sampler_missed_windows",
            "Windows whose pod sample did not finish within runtime.window (a wedged or slow \
             look into the pods): their judged pods were unknown for that window",
            m.sampler_missed.clone(),
        );
        m
    }

    /// One window whose sample missed its deadline.
    pub fn sampler_missed(&self) {
        self.sampler_missed.inc();
    }

    /// Count what each job's own ports carried this window, list every port's jobs, and
    /// remove the series of ports a job no longer holds.
    pub fn record_ports(&self, shares: &[PortShare]) {
        let Ok(mut known) = self.known_ports.lock() else {
            return;
        };
        let mut bytes_now = BTreeSet::new();
        let mut jobs_now = BTreeSet::new();
        for share in shares {
            let port = share.port.to_string();
            for job in &share.jobs {
                let labels = PortJobLabels {
                    device: share.device.clone(),
                    port: port.clone(),
                    namespace: job.namespace.clone(),
                    job: job.job.clone(),
                };
                self.port_jobs.get_or_create(&labels).set(1);
                jobs_now.insert(labels);
            }
            let Some(owner) = share.owner() else {
                continue;
            };
            for (direction, bytes) in [
                ("transmit", share.transmit_bytes),
                ("receive", share.receive_bytes),
            ] {
                let labels = JobPortLabels {
                    namespace: owner.namespace.clone(),
                    job: owner.job.clone(),
                    device: share.device.clone(),
                    port: port.clone(),
                    direction,
                };
                let counter = self.job_rdma_bytes.get_or_create(&labels);
                if let Some(b) = bytes {
                    counter.inc_by(b);
                }
                bytes_now.insert(labels);
            }
        }
        for gone in known.0.difference(&bytes_now) {
            self.job_rdma_bytes.remove(gone);
        }
        for gone in known.1.difference(&jobs_now) {
            self.port_jobs.remove(gone);
        }
        *known = (bytes_now, jobs_now);
    }

    /// Set every judged pod's series from `samples` and remove those of pods no longer in it.
    pub fn record(&self, samples: &[PodSample<'_>]) {
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        let mut now: BTreeMap<PodLabels, Known> = BTreeMap::new();
        for s in samples {
            let pod = PodLabels {
                namespace: s.namespace.to_owned(),
                pod: s.pod.to_owned(),
            };
            for t in Transport::ALL {
                self.transport
                    .get_or_create(&TransportLabels {
                        namespace: pod.namespace.clone(),
                        pod: pod.pod.clone(),
                        transport: t.as_str(),
                    })
                    .set(i64::from(t == s.verdict.transport));
            }
            if let Some(bytes) = s.verdict.internode_tcp_bytes {
                self.tcp_bytes.get_or_create(&pod).inc_by(bytes);
            }
            if let Some(bytes) = s.verdict.other_tcp_bytes {
                self.other_tcp_bytes.get_or_create(&pod).inc_by(bytes);
            }
            let mut counts: BTreeMap<QpLabels, i64> = BTreeMap::new();
            for qp in s.qps.into_iter().flatten() {
                let labels = QpLabels {
                    namespace: pod.namespace.clone(),
                    pod: pod.pod.clone(),
                    device: qp.device.clone(),
                    port: qp.port.map(|p| p.to_string()).unwrap_or_default(),
                    r#type: format!("{:?}", qp.qp_type).to_lowercase(),
                };
                *counts.entry(labels).or_default() += 1;
            }
            for (labels, n) in &counts {
                self.qps.get_or_create(labels).set(*n);
            }
            let owner = OwnerLabels {
                namespace: pod.namespace.clone(),
                pod: pod.pod.clone(),
                owner_kind: s.owner.map_or("Pod", |o| o.0).to_owned(),
                owner_name: s.owner.map_or(s.pod, |o| o.1).to_owned(),
            };
            self.owner.get_or_create(&owner).set(1);
            let entry = Known {
                qps: counts.into_keys().collect(),
                owner: Some(owner),
            };
            if let Some(old) = known.get(&pod) {
                for gone in old.qps.difference(&entry.qps) {
                    self.qps.remove(gone);
                }
                if old.owner != entry.owner
                    && let Some(o) = &old.owner
                {
                    self.owner.remove(o);
                }
            }
            now.insert(pod, entry);
        }
        for (pod, old) in known.iter() {
            if now.contains_key(pod) {
                continue;
            }
            for t in Transport::ALL {
                self.transport.remove(&TransportLabels {
                    namespace: pod.namespace.clone(),
                    pod: pod.pod.clone(),
                    transport: t.as_str(),
                });
            }
            self.tcp_bytes.remove(pod);
            self.other_tcp_bytes.remove(pod);
            for q in &old.qps {
                self.qps.remove(q);
            }
            if let Some(o) = &old.owner {
                self.owner.remove(o);
            }
        }
        *known = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::verdict::REASON_SOCKETS;

    fn text(r: &Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s
    }

    #[test]
    fn a_pod_s_series_are_one_hot_and_go_when_the_pod_goes() {
        let mut r = Registry::default();
        let m = PodMetrics::register(&mut r);
        let v = PodVerdict {
            transport: Transport::Sockets,
            reason: REASON_SOCKETS,
            why: "0 data-path QPs".into(),
            data_path_qps: Some(0),
            internode_tcp_bytes: Some(41_000),
            other_tcp_bytes: Some(7),
            rdma_bytes: None,
            clears: false,
        };
        let s = PodSample {
            namespace: "ml",
            pod: "w-0",
            owner: Some(("Job", "llm")),
            verdict: &v,
            qps: Some(&[]),
        };
        m.record(std::slice::from_ref(&s));
        m.record(std::slice::from_ref(&s));
        let t = text(&r);
        assert!(t.contains(
            "fabricgate_pod_transport{namespace=\"ml\",pod=\"w-0\",transport=\"sockets\"} 1"
        ));
        assert!(t.contains(
            "fabricgate_pod_transport{namespace=\"ml\",pod=\"w-0\",transport=\"rdma\"} 0"
        ));
        assert!(
            t.contains(
                "fabricgate_pod_internode_tcp_bytes_total{namespace=\"ml\",pod=\"w-0\"} 82000"
            ),
            "{t}"
        );
        assert!(t.contains(
            "fabricgate_pod_owner_info{namespace=\"ml\",pod=\"w-0\",owner_kind=\"Job\",owner_name=\"llm\"} 1"
        ));
        m.record(&[]);
        assert!(!text(&r).contains("pod=\"w-0\""), "{}", text(&r));
    }

    /// A job's own port counts its bytes per direction, window after window; a shared port is
    /// listed with each job and counts for none; a port the job gives up loses its series.
    #[test]
    fn a_jobs_own_port_counts_its_bytes_and_a_shared_port_lists_its_jobs() {
        use crate::transport::bandwidth::JobId;
        use fabricgate_probes::transport::ports::PortCounter;
        let mut r = Registry::default();
        let m = PodMetrics::register(&mut r);
        let job = |name: &str| JobId {
            namespace: "ml".into(),
            job: name.into(),
        };
        let share = |device: &str, jobs: Vec<JobId>, tx: Option<u64>| PortShare {
            device: device.into(),
            port: 1,
            jobs,
            others: Vec::new(),
            counter: PortCounter::DataWords,
            transmit_bytes: tx,
            receive_bytes: tx.map(|b| b / 2),
            unseen: None,
        };
        let window = [
            share("mlx5_0", vec![job("Job/llm")], Some(1_000)),
            share("mlx5_1", vec![job("Job/llm"), job("Job/eval")], Some(50)),
        ];
        m.record_ports(&window);
        m.record_ports(&window);
        let t = text(&r);
        let own = "fabricgate_job_rdma_bytes_total{namespace=\"ml\",job=\"Job/llm\",device=\"mlx5_0\",port=\"1\"";
        assert!(
            t.contains(&format!("{own},direction=\"transmit\"}} 2000")),
            "{t}"
        );
        assert!(
            t.contains(&format!("{own},direction=\"receive\"}} 1000")),
            "{t}"
        );
        assert!(
            !t.contains(
                "fabricgate_job_rdma_bytes_total{namespace=\"ml\",job=\"Job/llm\",device=\"mlx5_1\""
            ),
            "{t}"
        );
        for j in ["Job/llm", "Job/eval"] {
            assert!(
                t.contains(&format!(
                    "fabricgate_rdma_port_jobs{{device=\"mlx5_1\",port=\"1\",namespace=\"ml\",job=\"{j}\"}} 1"
                )),
                "{t}"
            );
        }
        // A window without a figure keeps the series and adds nothing.
        m.record_ports(&[share("mlx5_0", vec![job("Job/llm")], None)]);
        let t = text(&r);
        assert!(
            t.contains(&format!("{own},direction=\"transmit\"}} 2000")),
            "{t}"
        );
        assert!(!t.contains("device=\"mlx5_1\""), "{t}");
        m.record_ports(&[]);
        assert!(!text(&r).contains("Job/llm"));
    }
}
