//! The job's active fabric bandwidth: whose bytes each RDMA port carried. Pure: the ports the
//! sampler read (`probes::transport::ports`) and each pod's job in, one [`PortShare`] per port
//! out.
//!
//! A port whose data-path QPs all belong to one job is that job's: what it carried over the
//! window is the job's (`fabricgate_job_rdma_bytes_total`). A port shared by several jobs, or
//! with a QP of the kernel (`ko2iblnd`), of a host process or of a pod not judged here, is
//! listed with its holders and never apportioned by guess.

use fabricgate_probes::transport::PodTransportFacts;
use fabricgate_probes::transport::ports::{PortCounter, PortTraffic};
use serde::Serialize;
use std::collections::BTreeMap;

/// A job as metrics and messages name it: its namespace and `transport::jobs::JobKey::name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct JobId {
    pub namespace: String,
    pub job: String,
}

/// One port with data-path QPs: what it carried and whose it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortShare {
    pub device: String,
    pub port: u32,
    /// The jobs whose judged pods hold data-path QPs on it (sorted).
    pub jobs: Vec<JobId>,
    /// Other holders: the kernel, a host process, a pod not judged here (by UID).
    pub others: Vec<String>,
    pub counter: PortCounter,
    /// Over the window, IPoIB subtracted; `None` without a figure (`unseen` says why).
    pub transmit_bytes: Option<u64>,
    pub receive_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unseen: Option<String>,
}

impl PortShare {
    /// The one job the port belongs to; `None` when it is shared or has another holder.
    pub fn owner(&self) -> Option<&JobId> {
        match self.jobs.as_slice() {
            [job] if self.others.is_empty() => Some(job),
            _ => None,
        }
    }

    /// `mlx5_0/1`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.device, self.port)
    }
}

/// Every port the pods' data-path QPs are on, once, with its holders resolved to jobs by
/// `job_of` (a pod UID → its job; `None`: a pod not judged here).
pub fn port_shares(
    facts: &[PodTransportFacts],
    job_of: impl Fn(&str) -> Option<JobId>,
) -> Vec<PortShare> {
    let mut ports: BTreeMap<(String, u32), &PortTraffic> = BTreeMap::new();
    for port in facts.iter().flat_map(|f| &f.ports) {
        ports
            .entry((port.device.clone(), port.port))
            .or_insert(port);
    }
    ports
        .into_values()
        .map(|p| {
            let mut jobs = Vec::new();
            let mut others = p.others.clone();
            for uid in &p.pods {
                match job_of(uid) {
                    Some(job) if !jobs.contains(&job) => jobs.push(job),
                    Some(_) => {}
                    None => others.push(format!("pod {uid} (not judged)")),
                }
            }
            jobs.sort();
            PortShare {
                device: p.device.clone(),
                port: p.port,
                jobs,
                others,
                counter: p.counter.clone(),
                transmit_bytes: p.transmit_bytes,
                receive_bytes: p.receive_bytes,
                unseen: p.unseen.clone(),
            }
        })
        .collect()
}

/// A pod's data-path ports when every one of them is its job's and has a figure: what they
/// carried over the window, for `SocketsBesideIdleQueuePairs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobPorts {
    /// Sent plus received over the window, all the ports together.
    pub bytes: u64,
    /// `mlx5_0/1`, sorted.
    pub names: Vec<String>,
}

/// The ports of `facts`' data-path QPs that `in_scope(device, port)` keeps, when each is
/// `job`'s alone (per `shares`) and has a figure; `None` otherwise (no such port, a port
/// shared or without byte counters: only the QPs' presence can be judged).
pub fn job_ports(
    facts: &PodTransportFacts,
    shares: &[PortShare],
    job: Option<&JobId>,
    in_scope: impl Fn(&str, u32) -> bool,
) -> Option<JobPorts> {
    let job = job?;
    let mut bytes = 0u64;
    let mut names = Vec::new();
    for port in facts.ports.iter().filter(|p| in_scope(&p.device, p.port)) {
        let share = shares
            .iter()
            .find(|s| s.device == port.device && s.port == port.port)?;
        if share.owner() != Some(job) {
            return None;
        }
        bytes = bytes
            .saturating_add(share.transmit_bytes?)
            .saturating_add(share.receive_bytes?);
        names.push(share.name());
    }
    if names.is_empty() {
        return None;
    }
    names.sort();
    Some(JobPorts { bytes, names })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::transport::{InternodeTcp, Observed};
    use std::time::Duration;

    fn traffic(device: &str, pods: &[&str], others: &[&str], bytes: u64) -> PortTraffic {
        PortTraffic {
            device: device.into(),
            port: 1,
            link_layer: Some("InfiniBand".into()),
            counter: PortCounter::DataWords,
            transmit_bytes: Some(bytes),
            receive_bytes: Some(bytes / 2),
            subtracted: vec!["ib0".into()],
            window: Duration::from_secs(30),
            pods: pods.iter().map(|s| (*s).to_owned()).collect(),
            others: others.iter().map(|s| (*s).to_owned()).collect(),
            unseen: None,
        }
    }

    fn facts(uid: &str, ports: Vec<PortTraffic>) -> PodTransportFacts {
        PodTransportFacts {
            pod_uid: uid.into(),
            qps: Observed::Seen(Vec::new()),
            internode_tcp: Observed::Seen(InternodeTcp::default()),
            ports,
        }
    }

    fn job(name: &str) -> JobId {
        JobId {
            namespace: "ml".into(),
            job: name.into(),
        }
    }

    /// Two pods of one job on a port make it that job's; a second job, the kernel's QP or a
    /// pod not judged here make a port shared, listed with every holder and owned by none.
    #[test]
    fn a_port_is_a_jobs_only_when_every_data_path_qp_on_it_is_that_jobs() {
        let jobs: BTreeMap<&str, JobId> = [
            ("a0", job("Job/a")),
            ("a1", job("Job/a")),
            ("b0", job("Job/b")),
        ]
        .into();
        let shares = port_shares(
            &[
                facts(
                    "a0",
                    vec![
                        traffic("mlx5_0", &["a0", "a1"], &[], 1000),
                        traffic("mlx5_1", &["a0", "b0"], &[], 10),
                    ],
                ),
                facts("a1", vec![traffic("mlx5_0", &["a0", "a1"], &[], 1000)]),
                facts(
                    "b0",
                    vec![traffic("mlx5_2", &["b0"], &["kernel ko2iblnd"], 5)],
                ),
                facts("x", vec![traffic("mlx5_3", &["x", "stranger"], &[], 5)]),
            ],
            |uid| {
                jobs.get(uid)
                    .cloned()
                    .or_else(|| (uid == "x").then(|| job("Job/x")))
            },
        );
        let by: BTreeMap<String, &PortShare> = shares.iter().map(|s| (s.name(), s)).collect();
        assert_eq!(shares.len(), 4, "each port once: {shares:#?}");
        assert_eq!(by["mlx5_0/1"].owner(), Some(&job("Job/a")));
        assert_eq!(by["mlx5_0/1"].transmit_bytes, Some(1000));
        assert_eq!(by["mlx5_1/1"].owner(), None);
        assert_eq!(by["mlx5_1/1"].jobs, [job("Job/a"), job("Job/b")]);
        assert_eq!(by["mlx5_2/1"].owner(), None);
        assert_eq!(by["mlx5_2/1"].others, ["kernel ko2iblnd"]);
        assert_eq!(by["mlx5_3/1"].owner(), None);
        assert_eq!(by["mlx5_3/1"].others, ["pod stranger (not judged)"]);

        // A pod's ports count for its verdict only when all are its job's with a figure.
        let a0 = facts("a0", vec![traffic("mlx5_0", &["a0", "a1"], &[], 1000)]);
        let all = |_: &str, _: u32| true;
        assert_eq!(
            job_ports(&a0, &shares, Some(&job("Job/a")), all),
            Some(JobPorts {
                bytes: 1500,
                names: vec!["mlx5_0/1".into()]
            })
        );
        assert_eq!(job_ports(&a0, &shares, Some(&job("Job/b")), all), None);
        assert_eq!(job_ports(&a0, &shares, None, all), None);
        assert_eq!(
            job_ports(&a0, &shares, Some(&job("Job/a")), |_, _| false),
            None
        );
        let shared = facts(
            "a0",
            vec![
                traffic("mlx5_0", &["a0", "a1"], &[], 1000),
                traffic("mlx5_1", &["a0", "b0"], &[], 10),
            ],
        );
        assert_eq!(job_ports(&shared, &shares, Some(&job("Job/a")), all), None);
        let mut unseen = shares.clone();
        unseen[0].transmit_bytes = None;
        assert_eq!(job_ports(&a0, &unseen, Some(&job("Job/a")), all), None);
    }
}
