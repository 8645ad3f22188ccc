use super::*;
use crate::config::FeatureSection;
use crate::policy::devices::DeviceHysteresis;
use crate::policy::judge::{Facts, Judge};
use fabricgate_probes::host::SocketProblem;
use fabricgate_probes::rdma::{
    DeviceReport, LinkLayer, PciLink, PhysState, PortReport, PortState, Rate,
};
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourcePool, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

const DRA: &str = "rdma:\n  min_active_ports: 3\n  min_rate_gbps: 400\nnode:\n  recover_after: 2\n\
                   kubernetes:\n  dra:\n    drivers: [{name: dra.net}]\n";

fn port(up: bool) -> PortReport {
    PortReport {
        port: 1,
        state: Some(if up {
            PortState::Active
        } else {
            PortState::Down
        }),
        phys_state: Some(if up {
            PhysState::LinkUp
        } else {
            PhysState::Disabled
        }),
        rate: Some(Rate {
            gbps: 400.0,
            width: 4,
            speed: "NDR".into(),
        }),
        link_layer: Some(LinkLayer::InfiniBand),
        ..PortReport::default()
    }
}

fn pci(i: usize) -> String {
    format!("0000:{:02x}:00.0", 0x18 + i)
}

/// Four 400G HCAs `mlx5_0..3` at PCI `0000:18..1b:00.0`; `down` names those whose port is down.
fn node(down: &[&str]) -> ProbeReport {
    let mut r = ProbeReport::default();
    r.rdma.subsystem_present = true;
    r.rdma.devices = (0..4)
        .map(|i| {
            let name = format!("mlx5_{i}");
            DeviceReport {
                ports: vec![port(!down.contains(&name.as_str()))],
                pci: Some(PciLink {
                    address: pci(i),
                    ..PciLink::default()
                }),
                name,
                ..DeviceReport::default()
            }
        })
        .collect();
    r
}

fn attr(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..DeviceAttribute::default()
    }
}

/// A DraNet slice of `node` publishing `hcas` (index, with or without the rdmaDevice
/// attribute), as DraNet names and describes them.
fn slice(driver: &str, generation: i64, hcas: &[(usize, bool)]) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("node-a-{driver}-{generation}")),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some("node-a".into()),
            pool: ResourcePool {
                name: "node-a".into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(
                hcas.iter()
                    .map(|(i, rdma)| {
                        let mut attributes = BTreeMap::new();
                        // DraNet writes qualified names; the short form is the driver's own.
                        attributes.insert("pciAddress".to_owned(), attr(&pci(*i)));
                        if *rdma {
                            attributes
                                .insert(format!("{driver}/rdmaDevice"), attr(&format!("mlx5_{i}")));
                        }
                        Device {
                            name: format!("pci-{}", pci(*i).replace([':', '.'], "-")),
                            attributes: Some(attributes),
                            ..Device::default()
                        }
                    })
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        },
    }
}

/// The four HCAs published by `dra.net`, each with its rdmaDevice attribute.
fn all_four(c: &Config) -> DraFacts {
    published(
        &[slice(
            "dra.net",
            1,
            &[(0, true), (1, true), (2, true), (3, true)],
        )],
        &settings(c).drivers,
    )
}

/// DRA's section of `c`.
fn settings(c: &Config) -> DraSettings {
    DraSettings::of(c).unwrap()
}

/// [`super::assess`] with `c`'s DRA section.
fn assess(report: &ProbeReport, facts: Option<&DraFacts>, c: &Config) -> DraAssessment {
    super::assess(report, facts, &settings(c), c)
}

fn config(yaml: &str) -> Config {
    Config::parse(yaml).unwrap()
}

#[test]
fn published_devices_by_qualified_or_short_attribute_newest_generation_only() {
    let c = config(DRA);
    let drivers = &settings(&c).drivers;
    let facts = published(
        &[
            slice("dra.net", 1, &[(0, true)]),
            slice("dra.net", 2, &[(0, true), (1, false)]),
            slice("other.example.com", 1, &[(2, true)]),
        ],
        drivers,
    );
    assert!(facts.drivers_without_slices.is_empty());
    assert_eq!(
        facts.devices,
        vec![
            PublishedDevice {
                driver: "dra.net".into(),
                pool: "node-a".into(),
                device: "pci-0000-18-00-0".into(),
                rdma_device: Some("mlx5_0".into()),
                pci_address: Some(pci(0)),
            },
            PublishedDevice {
                driver: "dra.net".into(),
                pool: "node-a".into(),
                device: "pci-0000-19-00-0".into(),
                rdma_device: None,
                pci_address: Some(pci(1)),
            },
        ],
        "the generation-1 slice is replaced, the other driver is not configured"
    );
    assert_eq!(
        published(&[], drivers).drivers_without_slices,
        vec!["dra.net".to_owned()]
    );
}

#[test]
fn a_bad_published_hca_is_a_device_taint_and_the_node_stays_ready_in_device_scope() {
    let c = config(DRA);
    let facts = published(
        &[slice(
            "dra.net",
            1,
            &[(0, true), (1, true), (2, true), (3, false)],
        )],
        &settings(&c).drivers,
    );
    let out = assess(&node(&["mlx5_3"]), Some(&facts), &c);
    assert!(out.findings.is_empty(), "{:?}", out.findings);
    assert_eq!(out.taints.len(), 1, "{:?}", out.taints);
    let t = &out.taints[0];
    assert_eq!(
        (
            t.hca.as_str(),
            t.device.as_str(),
            t.reason.as_str(),
            t.pool.as_str()
        ),
        ("mlx5_3", "pci-0000-1b-00-0", "PortDown", "node-a"),
        "mapped by PCI address when the device has no rdmaDevice attribute"
    );
    assert!(out.own_problems.is_empty());

    // `both`: the bad HCA fails the node too; `node`: no rules.
    let both = config(&format!("{DRA}    taint_scope: both\n"));
    let out = assess(&node(&["mlx5_3"]), Some(&facts), &both);
    assert_eq!(out.taints.len(), 1);
    assert_eq!(out.findings.len(), 1);
    assert_eq!(out.findings[0].code, "PortDown");
    let node_scope = config(&format!("{DRA}    taint_scope: node\n"));
    let out = assess(&node(&["mlx5_3"]), Some(&facts), &node_scope);
    assert!(out.taints.is_empty() && out.findings.is_empty());
}

#[test]
fn a_missing_driver_a_missing_hca_an_unknown_device_and_two_drivers_for_one_hca() {
    let c =
        config("kubernetes:\n  dra:\n    drivers: [{name: dra.net}, {name: sriov.example.com}]\n");
    let drivers = &settings(&c).drivers;
    // dra.net has no slice; nobody publishes mlx5_3.
    let facts = published(
        &[slice(
            "sriov.example.com",
            1,
            &[(0, true), (1, true), (2, true)],
        )],
        drivers,
    );
    let out = assess(&node(&[]), Some(&facts), &c);
    let codes: Vec<&str> = out.findings.iter().map(|f| f.code).collect();
    assert_eq!(codes, vec![DRA_DRIVER_UNAVAILABLE, DRA_DEVICE_MISSING]);
    assert!(out.findings[0].message.contains("dra.net"));
    assert!(out.findings[1].message.contains("mlx5_3 (0000:1b:00.0)"));

    // Both drivers publish mlx5_0; dra.net also publishes an HCA this node lacks.
    let mut unknown = slice("dra.net", 1, &[(0, true), (3, true)]);
    if let Some(devices) = unknown.spec.devices.as_mut() {
        devices[1]
            .attributes
            .as_mut()
            .unwrap()
            .insert("dra.net/rdmaDevice".into(), attr("mlx5_9"));
    }
    let facts = published(
        &[
            unknown,
            slice("sriov.example.com", 1, &[(0, true), (1, true), (2, true)]),
        ],
        drivers,
    );
    let out = assess(&node(&["mlx5_0"]), Some(&facts), &c);
    let warnings: Vec<&str> = out.warnings.iter().map(|f| f.code).collect();
    assert!(warnings.contains(&DRA_DEVICE_UNMATCHED), "{warnings:?}");
    assert!(warnings.contains(&DRA_DEVICE_CONFLICT), "{warnings:?}");
    assert_eq!(
        out.taints
            .iter()
            .map(|t| t.driver.as_str())
            .collect::<Vec<_>>(),
        vec!["dra.net", "sriov.example.com"],
        "the bad HCA's device of each driver is tainted"
    );
    // mlx5_3 is published only under a name this node lacks: missing.
    assert_eq!(
        out.findings.iter().map(|f| f.code).collect::<Vec<_>>(),
        vec![DRA_DEVICE_MISSING]
    );
}

#[test]
fn a_device_in_a_pool_not_named_after_the_node_is_skipped_with_a_warning() {
    let c = config(DRA);
    // The node's own slice publishes mlx5_0..2; another slice of the node, in pool `other`,
    // publishes mlx5_2 and mlx5_3 (both bad).
    let mut foreign = slice("dra.net", 1, &[(2, true), (3, true)]);
    foreign.spec.pool.name = "other".into();
    let facts = published(
        &[
            slice("dra.net", 1, &[(0, true), (1, true), (2, true)]),
            foreign,
        ],
        &settings(&c).drivers,
    );
    assert_eq!(facts.devices.len(), 3);
    assert_eq!(facts.foreign_pool.len(), 2);
    let out = assess(&node(&["mlx5_2", "mlx5_3"]), Some(&facts), &c);
    assert_eq!(
        out.taints
            .iter()
            .map(|t| (t.pool.as_str(), t.hca.as_str()))
            .collect::<Vec<_>>(),
        vec![("node-a", "mlx5_2")],
        "only the node's own pool is tainted"
    );
    let foreign: Vec<&Finding> = out
        .warnings
        .iter()
        .filter(|f| f.code == DRA_FOREIGN_POOL)
        .collect();
    assert_eq!(foreign.len(), 1, "{:?}", out.warnings);
    assert!(
        foreign[0].message.contains("pool other")
            && foreign[0]
                .message
                .contains("pci-0000-1a-00-0, pci-0000-1b-00-0"),
        "{}",
        foreign[0].message
    );
    // mlx5_3 is published only in the foreign pool: missing on the node.
    assert_eq!(
        out.findings.iter().map(|f| f.code).collect::<Vec<_>>(),
        vec![DRA_DEVICE_MISSING]
    );
}

#[test]
fn registration_sockets_and_the_registry_mount() {
    let c = config(DRA);
    let mut r = node(&[]);
    r.host.dra_problems.push(SocketProblem {
        name: "dra.net".into(),
        problem: "/r/dra.net-reg.sock refuses connections".into(),
    });
    // Before the slice watch has listed, only the sockets are judged.
    let out = assess(&r, None, &c);
    assert_eq!(out.findings.len(), 1);
    assert_eq!(out.findings[0].code, DRA_DRIVER_UNAVAILABLE);
    assert!(out.findings[0].message.contains("refuses connections"));
    r.host.dra_problems.clear();
    r.host.dra_registry_missing = true;
    let out = assess(&r, None, &c);
    assert!(out.findings.is_empty());
    assert_eq!(out.own_problems.len(), 1);
    // DRA off: nothing at all.
    let out = assess(&r, None, &config("{}"));
    assert_eq!(out, DraAssessment::default());
}

#[test]
fn device_taints_go_at_once_and_come_off_after_recover_after_good_probes() {
    let c = config(DRA);
    let facts = all_four(&c);
    let bad = assess(&node(&["mlx5_3"]), Some(&facts), &c).taints;
    let good = assess(&node(&[]), Some(&facts), &c).taints;
    assert!(good.is_empty());
    let mut h = DeviceHysteresis::default();
    assert_eq!(h.apply(&bad, 2), bad);
    assert_eq!(h.apply(&good, 2), bad, "one good probe: kept");
    assert_eq!(h.apply(&bad, 2), bad, "bad again: the count starts over");
    assert_eq!(h.apply(&good, 2), bad);
    assert!(
        h.apply(&good, 2).is_empty(),
        "two good probes in a row: removed"
    );
    assert_eq!(h.add(&bad), bad, "an event taints at once");
}

/// The kernel-event path: a port read down between full probes taints its HCA at once while the
/// node stays ready (3 of 4 ports); a later event with it up removes nothing, only full probes do.
#[test]
fn a_port_event_taints_the_bad_hca_at_once_and_never_untaints() {
    let c = config(DRA);
    let facts = all_four(&c);
    let mut j = Judge::new(&c);
    j.resume_validated();
    let full = |j: &mut Judge, report: &ProbeReport| {
        j.probe(Facts {
            report,
            peer_finding: None,
            devices: &[seen(&c, &facts, None)],
        })
        .verdict
    };
    let v = full(&mut j, &node(&[]));
    assert!(v.ready && v.device_taints.is_empty(), "{v:?}");

    // 3 of 4: still ready, and the Judge itself gives the bad HCA its device taint; nothing
    // else of the last verdict changes.
    let tainted = j
        .port_event(&node(&["mlx5_2"]), &v)
        .expect("a new device taint is a new verdict");
    assert!(tainted.ready, "3 of 4: still ready");
    let taints = tainted.device_taints.clone();
    assert_eq!(taints.len(), 1, "{taints:?}");
    assert_eq!(
        (taints[0].hca.as_str(), taints[0].reason.as_str()),
        ("mlx5_2", "PortDown")
    );
    assert_eq!(
        crate::policy::Verdict {
            device_taints: Vec::new(),
            ..tainted.clone()
        },
        v
    );
    assert_eq!(
        j.port_event(&node(&["mlx5_2"]), &tainted),
        None,
        "the same taint again: nothing to publish"
    );
    assert_eq!(
        j.port_event(&node(&[]), &tainted),
        None,
        "an event never untaints"
    );

    // Full probes: kept through the first good one, gone after recover_after (2).
    assert_eq!(full(&mut j, &node(&[])).device_taints, taints);
    assert!(full(&mut j, &node(&[])).device_taints.is_empty());
}

/// Rules refused while a device is tainted: the device path protects nothing, so
/// the Node is tainted (`DraDeviceRulesRefused`); refused with nothing tainted: a warning;
/// written again: the node recovers through the hysteresis.
#[test]
fn refused_rules_of_a_tainted_device_taint_the_node_instead() {
    let c = config(DRA);
    let facts = all_four(&c);
    let mut j = Judge::new(&c);
    j.resume_validated();
    let refused = RulesState::Refused("x: HTTP 422 denied by a webhook".into());
    let judge = |j: &mut Judge, down: &[&str], rules: &RulesState| {
        j.probe(Facts {
            report: &node(down),
            peer_finding: None,
            devices: &[seen(&c, &facts, Some(rules))],
        })
        .verdict
    };
    let v = judge(&mut j, &[], &refused);
    assert!(v.ready, "nothing tainted: ready");
    assert!(
        v.rdma
            .part
            .warnings
            .iter()
            .any(|w| w.code == DRA_DEVICE_RULES_REFUSED),
        "{:?}",
        v.rdma.part.warnings
    );
    let v = judge(&mut j, &["mlx5_3"], &refused);
    assert!(!v.ready && !v.taints.is_empty(), "{v:?}");
    let fabric = v
        .conditions
        .iter()
        .find(|c| c.type_ == "FabricReady")
        .unwrap();
    assert_eq!(fabric.reason, DRA_DEVICE_RULES_REFUSED);
    assert!(
        fabric.message.contains("mlx5_3") && fabric.message.contains("not protecting anything"),
        "{}",
        fabric.message
    );
    assert_eq!(v.device_taints.len(), 1, "the writer keeps trying");
    // The same with the rules written: 3 of 4 ports, device scope: ready again after
    // recover_after (2) judgments.
    let v = judge(&mut j, &["mlx5_3"], &RulesState::On);
    assert!(!v.ready);
    let v = judge(&mut j, &["mlx5_3"], &RulesState::On);
    assert!(v.ready, "{v:?}");
    assert_eq!(v.device_taints.len(), 1);
}

/// mlx5_3's device (`pci-0000-1b-00-0`) allocated to pod train/worker-0's claim.
fn mlx5_3_held_by_worker_0() -> ClaimedDevice {
    ClaimedDevice {
        driver: "dra.net".into(),
        pool: "node-a".into(),
        device: "pci-0000-1b-00-0".into(),
        claim: "train/worker-0-rdma".into(),
        pods: vec![ClaimPod {
            name: "train/worker-0".into(),
            uid: "0b7d2c1e-worker-0".into(),
        }],
    }
}

#[test]
fn an_absent_hca_held_by_a_claim_is_in_use_not_unmatched_and_never_tainted() {
    let c = config(DRA);
    let mut facts = all_four(&c);
    // mlx5_3 left the node's namespace (exclusive RDMA netns mode, moved into a pod).
    let mut probe = node(&[]);
    probe.rdma.devices.truncate(3);
    let without = assess(&probe, Some(&facts), &c);
    let codes: Vec<&str> = without.warnings.iter().map(|f| f.code).collect();
    assert_eq!(codes, vec![DRA_DEVICE_UNMATCHED], "no claim: as before");

    facts.claimed.push(mlx5_3_held_by_worker_0());
    let held = assess(&probe, Some(&facts), &c);
    let codes: Vec<&str> = held.warnings.iter().map(|f| f.code).collect();
    assert_eq!(codes, vec![DRA_DEVICE_IN_USE]);
    let message = &held.warnings[0].message;
    assert!(message.contains("mlx5_3"), "{message}");
    assert!(message.contains("train/worker-0-rdma"), "{message}");
    assert!(message.contains("pod train/worker-0"), "{message}");
    assert!(held.findings.is_empty(), "{:?}", held.findings);
    assert!(held.taints.is_empty());
    assert_eq!(
        held.in_use,
        vec![InUseHca {
            hca: "mlx5_3".into(),
            claim: "train/worker-0-rdma".into(),
        }]
    );

    // A claim on another device does not excuse this one.
    facts.claimed[0].device = "pci-0000-1a-00-0".into();
    let other = assess(&probe, Some(&facts), &c);
    let codes: Vec<&str> = other.warnings.iter().map(|f| f.code).collect();
    assert_eq!(codes, vec![DRA_DEVICE_UNMATCHED]);
}

/// The figures recorded after a judgment are the full probe's, as the Judge saw them: a later
/// kernel event's assessment through the same view (the event path) does not replace them.
#[test]
fn the_recorded_figures_are_the_full_probes_assessment() {
    let c = config(DRA);
    let mut facts = all_four(&c);
    facts.claimed.push(mlx5_3_held_by_worker_0());
    let mut probe = node(&[]);
    probe.rdma.devices.truncate(3);
    let view = DraView::new(std::sync::Arc::new(settings(&c)), Some(facts), None);
    let judged = view.assess(&probe, &c);
    assert_eq!(judged.ports_in_use, 1);
    // The event path reads the ports again: mlx5_3 back in the node's namespace, down.
    let event = view.assess(&node(&["mlx5_3"]), &c);
    assert_eq!(event.ports_in_use, 0, "the event's own assessment is fresh");
    let recorded = view.first_assessment(&node(&["mlx5_3"]), &c);
    assert_eq!(
        recorded.in_use,
        [InUseHca {
            hca: "mlx5_3".into(),
            claim: "train/worker-0-rdma".into(),
        }]
    );
}

/// An HCA a claim holds, gone from the node's namespace, is not a lost port.
/// Four HCAs required, one moved into a pod: the node is judged on the other three; the same
/// absence without a claim is three of four ports, not validated.
#[test]
fn the_ports_of_an_hca_a_claim_holds_are_not_required_of_the_node() {
    let c = config(&DRA.replace("min_active_ports: 3", "min_active_ports: 4"));
    let mut facts = all_four(&c);
    let mut probe = node(&[]);
    probe.rdma.devices.truncate(3);
    let judge = |facts: &DraFacts| judged_validated(&c, &probe, facts);
    let lost = judge(&facts);
    assert!(!lost.ready, "no claim: a port is missing");
    assert_eq!(lost.rdma.required_ports, 4);

    facts.claimed.push(mlx5_3_held_by_worker_0());
    assert_eq!(assess(&probe, Some(&facts), &c).in_use_ports(), 1);
    let held = judge(&facts);
    assert!(held.ready, "{held:?}");
    assert_eq!((held.rdma.usable_ports, held.rdma.required_ports), (3, 3));
    assert!(
        held.rdma
            .part
            .warnings
            .iter()
            .any(|w| w.code == DRA_DEVICE_IN_USE)
    );
}

/// mlx5_3 as train/worker-0's own network namespace lists it (RDMA netlink from a socket
/// opened there), its port in `state`/`phys`.
fn mlx5_3_in_worker_0(state: PortState, phys: PhysState) -> PodNamespaceHcas {
    PodNamespaceHcas {
        pod: "train/worker-0".into(),
        ports: Observed::Seen(vec![NetlinkPort {
            device: "mlx5_3".into(),
            port: 1,
            state: Some(state),
            physical_state: Some(phys),
            netdev: Some("net1".into()),
        }]),
    }
}

/// "Probes it in that namespace where it can": an in-use HCA seen in its
/// pod's namespace is judged there. Port up: in use, nothing else. Port down: a fault of that
/// HCA, so its DRA device gets a DeviceTaintRule (no new claim gets it), while the node stays
/// judged on what is left (its taint would evict the pod that holds the HCA).
#[test]
fn an_in_use_hca_seen_in_its_pods_namespace_is_judged_there_never_the_node() {
    let c = config(&DRA.replace("min_active_ports: 3", "min_active_ports: 4"));
    let mut facts = all_four(&c);
    facts.claimed.push(mlx5_3_held_by_worker_0());
    let mut probe = node(&[]);
    probe.rdma.devices.truncate(3);
    let judge = |facts: &DraFacts| judged_validated(&c, &probe, facts);

    facts.in_pods = vec![mlx5_3_in_worker_0(PortState::Active, PhysState::LinkUp)];
    let up = assess(&probe, Some(&facts), &c);
    assert!(up.taints.is_empty(), "{:?}", up.taints);
    assert_eq!(up.in_use_ports(), 1);
    let message = &up.warnings[0].message;
    assert!(
        message.contains("seen in pod train/worker-0's network namespace: port 1 ACTIVE (LinkUp)"),
        "{message}"
    );
    assert!(judge(&facts).ready);

    facts.in_pods = vec![mlx5_3_in_worker_0(PortState::Down, PhysState::Disabled)];
    let down = assess(&probe, Some(&facts), &c);
    assert_eq!(down.taints.len(), 1, "{:?}", down.taints);
    let taint = &down.taints[0];
    assert_eq!(
        (
            taint.device.as_str(),
            taint.hca.as_str(),
            taint.reason.as_str()
        ),
        ("pci-0000-1b-00-0", "mlx5_3", "PortDown")
    );
    assert!(
        taint
            .message
            .contains("mlx5_3/1: state DOWN, phys Disabled in pod train/worker-0's")
            && taint.message.contains("claim train/worker-0-rdma"),
        "{}",
        taint.message
    );
    assert!(down.findings.is_empty(), "{:?}", down.findings);
    assert_eq!(down.in_use_ports(), 1);
    let verdict = judge(&facts);
    assert!(
        verdict.ready,
        "the node is judged on the other three: {verdict:?}"
    );
    assert_eq!(verdict.device_taints.len(), 1);

    // Not activated by the subnet manager: its own code, as on the node.
    facts.in_pods = vec![mlx5_3_in_worker_0(PortState::Init, PhysState::LinkUp)];
    assert_eq!(
        assess(&probe, Some(&facts), &c).taints[0].reason,
        "PortNotActivatedBySM"
    );

    // taint_scope node: no device rules, and still not the node.
    let node_scope = config(&format!(
        "{}    taint_scope: node\n",
        DRA.replace("min_active_ports: 3", "min_active_ports: 4")
    ));
    facts.in_pods = vec![mlx5_3_in_worker_0(PortState::Down, PhysState::Disabled)];
    let scoped = assess(&probe, Some(&facts), &node_scope);
    assert!(scoped.taints.is_empty() && scoped.findings.is_empty());
}

/// Looked into and not there, or not looked into: in use, not judged, with what was seen.
#[test]
fn an_in_use_hca_its_pods_namespace_does_not_show_says_what_was_seen_and_is_not_judged() {
    let c = config(DRA);
    let mut facts = all_four(&c);
    facts.claimed.push(mlx5_3_held_by_worker_0());
    let mut probe = node(&[]);
    probe.rdma.devices.truncate(3);

    let not_looked = assess(&probe, Some(&facts), &c);
    assert!(
        not_looked.warnings[0]
            .message
            .contains("looked into with runtime.enabled"),
        "{}",
        not_looked.warnings[0].message
    );

    facts.in_pods = vec![
        PodNamespaceHcas {
            pod: "train/worker-0".into(),
            ports: Observed::Seen(Vec::new()),
        },
        // Another pod's namespace is never taken for the claim's.
        mlx5_3_in_worker_0(PortState::Down, PhysState::Disabled),
    ];
    facts.in_pods[1].pod = "train/other".into();
    let empty = assess(&probe, Some(&facts), &c);
    assert!(empty.taints.is_empty());
    assert_eq!(empty.in_use_ports(), 1);
    assert!(
        empty.warnings[0]
            .message
            .contains("not found in its pods' network namespaces either (train/worker-0's namespace lists no RDMA device)"),
        "{}",
        empty.warnings[0].message
    );

    facts.in_pods = vec![PodNamespaceHcas {
        pod: "train/worker-0".into(),
        ports: Observed::Unseen {
            reason: "cannot enter the network namespace /proc/4242/ns/net: Operation not permitted"
                .into(),
        },
    }];
    let denied = assess(&probe, Some(&facts), &c);
    assert!(denied.taints.is_empty());
    assert!(
        denied.warnings[0]
            .message
            .contains("train/worker-0: cannot enter the network namespace"),
        "{}",
        denied.warnings[0].message
    );
}

/// A training pod that takes every HCA of the node (one claim for all of them, the common
/// whole-node job): the node's own namespace is left with no RDMA device at all. That is no
/// `NoRDMADevices`: nothing is required of the node beyond what its pods hold, and failing it
/// would taint (with `NoExecute`, evict) the very pod using them.
#[test]
fn a_node_whose_every_hca_is_in_a_pod_is_not_a_node_without_rdma() {
    let c = config(&DRA.replace("min_active_ports: 3", "min_active_ports: 4"));
    let mut facts = all_four(&c);
    let mut probe = node(&[]);
    probe.rdma.devices.clear();
    let judge = |facts: &DraFacts| judged_validated(&c, &probe, facts);
    let gone = judge(&facts);
    assert!(!gone.ready, "no claim: every HCA is missing");
    for (i, device) in ["pci-0000-18-00-0", "pci-0000-19-00-0", "pci-0000-1a-00-0"]
        .iter()
        .enumerate()
    {
        facts.claimed.push(ClaimedDevice {
            device: (*device).into(),
            ..mlx5_3_held_by_worker_0()
        });
        assert!(!judge(&facts).ready, "{} of 4 held", i + 1);
    }
    facts.claimed.push(mlx5_3_held_by_worker_0());
    let all_held = judge(&facts);
    assert!(all_held.ready, "{all_held:?}");
    assert_eq!(
        (all_held.rdma.usable_ports, all_held.rdma.required_ports),
        (0, 0)
    );
}

/// One judgment of `probe` with `facts` by a Judge of `c` on a node already validated.
fn judged_validated(c: &Config, probe: &ProbeReport, facts: &DraFacts) -> crate::policy::Verdict {
    let mut j = Judge::new(c);
    j.resume_validated();
    j.probe(Facts {
        report: probe,
        peer_finding: None,
        devices: &[seen(c, facts, Some(&RulesState::On))],
    })
    .verdict
}

/// What the agent hands the Judge: the slices and claims, the rule writer's state.
fn seen(
    c: &Config,
    facts: &DraFacts,
    rules: Option<&RulesState>,
) -> std::sync::Arc<dyn DeviceView> {
    std::sync::Arc::new(DraView::new(
        std::sync::Arc::new(settings(c)),
        Some(facts.clone()),
        rules.cloned(),
    ))
}
