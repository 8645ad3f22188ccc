//! Device-plugin liveness: what the agent requires of the kubelet's device plugins besides the
//! hardware. Two sources: the watched Node's resources ([`device_plugin_findings`]) and what the
//! probe saw on the host ([`host_findings`], from [`fabricgate_probes::host`]); handed to the
//! Judge together as a [`DeviceView`] ([`PluginView`]).

use crate::config::{Config, KubernetesRequirements};
use crate::policy::devices::{DeviceAssessment, DeviceTaint, DeviceView};
use crate::policy::{Finding, Scope};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::host::HostReport;
use k8s_openapi::api::core::v1::Node;

/// Reason of the findings about the device plugins (`kubernetes.rdma_resources`,
/// `kubernetes.device_plugin_sockets`, the device nodes they hand out).
pub const DEVICE_PLUGIN_UNAVAILABLE: &str = "DevicePluginUnavailable";

/// What the device plugins show at one moment, handed to the Judge: the watched Node's
/// findings ([`device_plugin_findings`], a kubelet restart held back by
/// [`super::node_checks::NodeChecks`]); the sockets and device nodes come with each probe's
/// host report. Its findings make the RDMA part not ready after the hardware's own, so a
/// healthy fabric with a dead plugin is not ready and the condition names the resource.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PluginView {
    pub node_findings: Vec<Finding>,
}

impl DeviceView for PluginView {
    fn assess(&self, report: &ProbeReport, config: &Config) -> DeviceAssessment {
        let host = host_findings(&report.host, &config.kubernetes);
        let mut findings = self.node_findings.clone();
        findings.extend(host.findings);
        DeviceAssessment {
            findings,
            own_problems: host.own_problems,
            explains_missing_devices: host.incomplete_device_set,
            ..DeviceAssessment::default()
        }
    }

    fn taints_refused(&self, _taints: &[DeviceTaint]) -> Option<Finding> {
        None
    }
}

/// Findings about the device-plugin resources `resources` (`kubernetes.rdma_resources`) on
/// `node`: each must be in `status.capacity` and have `status.allocatable` > 0. The kubelet
/// drops a resource's allocatable to 0 when its plugin's endpoint goes away (plugin crashed,
/// or a kubelet restart the plugin did not re-register after), and a resource no plugin ever
/// registered is absent. Empty `resources`: nothing is checked.
pub fn device_plugin_findings(node: &Node, resources: &[String]) -> Vec<Finding> {
    if resources.is_empty() {
        return Vec::new();
    }
    let node_name = node.metadata.name.as_deref().unwrap_or("this node");
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());
    let mut out = Vec::new();
    for r in resources {
        let cap = capacity.and_then(|c| c.get(r)).map(|q| q.0.as_str());
        let alloc = allocatable.and_then(|a| a.get(r)).map(|q| q.0.as_str());
        let message = match (cap, alloc) {
            (None, _) => format!(
                "device-plugin resource {r} is not in the Node's status.capacity: no device \
                 plugin registered it with the kubelet; check that the device plugin \
                 DaemonSet runs on {node_name} and advertises {r} (resource name in its config)"
            ),
            (Some(_), Some(a)) if positive(a) => continue,
            (Some(c), a) => format!(
                "device-plugin resource {r} has allocatable {} (capacity {c}): the kubelet \
                 lost the plugin's endpoint, so pods get no RDMA devices; check the device \
                 plugin pod on {node_name} (restart it if it runs: a kubelet restart needs \
                 it to register again) and the kubelet log",
                a.unwrap_or("absent")
            ),
        };
        out.push(Finding {
            scope: Scope::Rdma,
            code: DEVICE_PLUGIN_UNAVAILABLE,
            message,
        });
    }
    out
}

/// Whether `node` shows what a kubelet restart shows until the device plugins register again:
/// every resource of `resources` in the Node's capacity and allocatable, with 0 in both (the
/// kubelet zeroes its plugin resources when it starts; a plugin that dies under a running
/// kubelet keeps its capacity for 5 minutes, allocatable 0). Measured on a real kubelet
/// v1.37 (docs/testing.md, "The real node"). Empty `resources`: false.
pub fn kubelet_restart_signature(node: &Node, resources: &[String]) -> bool {
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());
    !resources.is_empty()
        && resources.iter().all(|r| {
            let cap = capacity.and_then(|c| c.get(r)).map(|q| q.0.as_str());
            let alloc = allocatable.and_then(|a| a.get(r)).map(|q| q.0.as_str());
            matches!((cap, alloc), (Some(c), Some(a)) if !positive(c) && !positive(a))
        })
}

/// What [`host_findings`] makes of the probe's host report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginHostFindings {
    /// `DevicePluginUnavailable` findings about the node.
    pub findings: Vec<Finding>,
    /// The agent cannot look (the device-plugins directory is not mounted): an agent error.
    pub own_problems: Vec<String>,
    /// Some selected devices' nodes are missing, others present: the verbs probe's "cannot
    /// open" for the missing ones is then the plugin's fault, not the agent's deployment.
    pub incomplete_device_set: bool,
}

/// The device plugins' sockets (`kubernetes.device_plugin_sockets`) and the device nodes of the
/// selected RDMA devices, as the probe found them on the host.
pub fn host_findings(host: &HostReport, k: &KubernetesRequirements) -> PluginHostFindings {
    let mut out = PluginHostFindings::default();
    let dir = &k.device_plugin_dir;
    if host.plugin_dir_missing {
        out.own_problems.push(format!(
            "kubernetes.device_plugin_sockets are checked in {dir} but it is not a directory \
             inside the agent's container (mount the kubelet's device-plugins directory there \
             read-only)"
        ));
    }
    for s in &host.socket_problems {
        out.findings.push(Finding {
            scope: Scope::Rdma,
            code: DEVICE_PLUGIN_UNAVAILABLE,
            message: format!(
                "device-plugin socket {} is not registered with the kubelet: {}; the device \
                 plugin is not running on this node (ls {dir} shows the registered plugins); \
                 restart the device-plugin pod",
                s.name, s.problem
            ),
        });
    }
    if !host.missing_device_nodes.is_empty() {
        out.incomplete_device_set = true;
        out.findings.push(Finding {
            scope: Scope::Rdma,
            code: DEVICE_PLUGIN_UNAVAILABLE,
            message: format!(
                "the device plugin hands out an incomplete set of RDMA devices: {} missing in \
                 the agent's container, which gets its devices from {} as training pods do; the \
                 plugin probably started before the driver created them; restart the \
                 device-plugin pod on this node",
                host.missing_device_nodes.join(", "),
                k.rdma_resources.join(", ")
            ),
        });
    }
    out
}

/// Whether a Kubernetes quantity is greater than zero (`"0"`, `"0k"`, `"-1"`, garbage: no).
fn positive(q: &str) -> bool {
    let q = q.trim();
    if q.starts_with('-') {
        return false;
    }
    let number: String = q
        .trim_start_matches('+')
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    number.parse::<f64>().is_ok_and(|n| n > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::host::SocketProblem;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    const R: &str = "rdma/hca_shared_devices_a";

    fn node(capacity: &[(&str, &str)], allocatable: &[(&str, &str)]) -> Node {
        let q = |kv: &[(&str, &str)]| -> BTreeMap<String, Quantity> {
            kv.iter()
                .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                .collect()
        };
        Node {
            metadata: ObjectMeta {
                name: Some("gpu-1".into()),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(NodeStatus {
                capacity: Some(q(capacity)),
                allocatable: Some(q(allocatable)),
                ..NodeStatus::default()
            }),
        }
    }

    #[test]
    fn nothing_is_checked_without_resources() {
        assert!(device_plugin_findings(&node(&[], &[]), &[]).is_empty());
    }

    #[test]
    fn a_registered_resource_with_allocatable_passes() {
        let n = node(&[(R, "1k")], &[(R, "1000")]);
        assert!(device_plugin_findings(&n, &[R.into()]).is_empty());
    }

    #[test]
    fn allocatable_zero_or_missing_names_the_resource() {
        for n in [
            node(&[(R, "1000")], &[(R, "0")]),
            node(&[(R, "1000")], &[]),
            node(&[], &[]),
            Node::default(),
        ] {
            let f = device_plugin_findings(&n, &[R.into(), "cpu".into()]);
            assert!(!f.is_empty(), "{n:?}");
            assert_eq!(f[0].code, DEVICE_PLUGIN_UNAVAILABLE);
            assert!(f[0].message.contains(R), "{}", f[0].message);
            assert!(f[0].message.contains("check"), "{}", f[0].message);
        }
    }

    #[test]
    fn quantities() {
        for (q, want) in [
            ("1", true),
            ("1k", true),
            ("0.5", true),
            ("0", false),
            ("0k", false),
            ("-3", false),
            ("", false),
            ("x", false),
        ] {
            assert_eq!(positive(q), want, "{q}");
        }
    }

    #[test]
    fn only_zero_capacity_and_allocatable_of_every_resource_reads_as_a_kubelet_restart() {
        let r = [R.to_owned()];
        // What the kubelet shows between its restart and the plugin registering again.
        assert!(kubelet_restart_signature(
            &node(&[(R, "0")], &[(R, "0")]),
            &r
        ));
        // A plugin that died under a running kubelet: capacity kept.
        assert!(!kubelet_restart_signature(
            &node(&[(R, "4")], &[(R, "0")]),
            &r
        ));
        // Never registered.
        assert!(!kubelet_restart_signature(&node(&[], &[]), &r));
        assert!(!kubelet_restart_signature(&node(&[(R, "0")], &[]), &r));
        // Healthy.
        assert!(!kubelet_restart_signature(
            &node(&[(R, "4")], &[(R, "4")]),
            &r
        ));
        // One resource back already: not a restart any more.
        let two = [R.to_owned(), "nvidia.com/hostdev".to_owned()];
        let n = node(
            &[(R, "0"), ("nvidia.com/hostdev", "8")],
            &[(R, "0"), ("nvidia.com/hostdev", "8")],
        );
        assert!(!kubelet_restart_signature(&n, &two));
        assert!(!kubelet_restart_signature(
            &node(&[(R, "0")], &[(R, "0")]),
            &[]
        ));
    }

    #[test]
    fn the_hosts_plugin_facts_become_findings_and_agent_errors() {
        let k = KubernetesRequirements {
            rdma_resources: vec![R.into()],
            device_plugin_dir: "/var/lib/kubelet/device-plugins".into(),
            device_plugin_sockets: vec!["rdma.sock".into()],
            ..KubernetesRequirements::default()
        };
        assert_eq!(
            host_findings(&HostReport::default(), &k),
            PluginHostFindings::default()
        );
        let socket = HostReport {
            socket_problems: vec![SocketProblem {
                name: "rdma.sock".into(),
                problem: "/var/lib/kubelet/device-plugins/rdma.sock does not exist".into(),
            }],
            ..HostReport::default()
        };
        let found = host_findings(&socket, &k);
        assert_eq!(found.findings.len(), 1);
        assert_eq!(found.findings[0].code, DEVICE_PLUGIN_UNAVAILABLE);
        let m = &found.findings[0].message;
        assert!(
            m.contains("rdma.sock is not registered") && m.contains("does not exist"),
            "{m}"
        );
        let blind = HostReport {
            plugin_dir_missing: true,
            ..HostReport::default()
        };
        let found = host_findings(&blind, &k);
        assert!(found.findings.is_empty());
        assert!(found.own_problems[0].contains("not a directory inside the agent's container"));
        let incomplete = HostReport {
            missing_device_nodes: vec!["/dev/infiniband/uverbs4 (mlx5_4)".into()],
            ..HostReport::default()
        };
        let found = host_findings(&incomplete, &k);
        assert!(found.incomplete_device_set);
        let m = &found.findings[0].message;
        assert!(m.contains("uverbs4 (mlx5_4)") && m.contains(R), "{m}");
    }
}
