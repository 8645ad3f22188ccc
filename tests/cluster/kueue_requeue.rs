//! After admission, for real: Kueue v0.19's manager, kube-controller-manager and
//! kube-scheduler on the shared control plane, the `fabricgate admission-check` controller as
//! its own process and a real agent on each fixture Node (the `kueue` tests' harness,
//! tests/cluster/kueue.rs). A gang Kueue admitted whose member node turns unvalidated (its
//! agent's port down), or whose member pod its agent finds on sockets, for
//! `gang.requeue_grace` (short here) is set `Retry`: Kueue evicts it whole and admits it again
//! on validated nodes. A flap shorter than the grace does nothing; the breaker
//! (`gang.max_requeues_per_window`) holds a fleet-wide event; `gang.after_admission: ignore`
//! requeues nothing.
//!
//! The bad-input tests play Kueue's part themselves (they write the Workloads' status by
//! hand, with the `admission_check` tests' helpers) and run with Kueue's manager stopped.

use crate::admission_check as ac;
use crate::common::controlplane::ControlPlane;
use crate::common::wait_until;
use crate::kueue::{
    Controller, Fleet, JOB, NS, WORKERS, WorkloadWatch, apply_queues, assigned_nodes,
    bound_pods_of, capture_output, check_state, condition_true, doc_yaml, start,
    wait_admitted_and_bound, wait_queue_active, wait_until_ctx, workload_of,
};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// `gang.requeue_grace` of these tests (the default is 60 s).
const GRACE: Duration = Duration::from_secs(5);
/// A gang scheduling gate of this test's own (as a provisioning step might hold pods): the
/// gang's pods exist but are not bound until it is removed.
const HOLD: &str = "example.com/hold";
const REQUEUED: &str = "fabricgate_admission_checks_total{result=\"requeued\"}";

/// The controller's `gang:` lines: the fixture agents have no verbs (the pair exchange runs
/// over the side channel), a short grace and back-off, and `extra`.
fn gang(grace: Duration, extra: &str) -> String {
    format!(
        "  require_rdma: false\n  retry_backoff: 1s\n  requeue_grace: {}s\n{extra}",
        grace.as_secs()
    )
}

/// The Job of docs/gangs.md as `name`, with `workers` pods of `gpus` GPUs and 1 CPU each;
/// `hold`: its pods also carry the [`HOLD`] scheduling gate.
fn gang_job(name: &str, workers: usize, gpus: u32, hold: bool) -> String {
    let mut job: Value = serde_norway::from_str(&doc_yaml("job")).expect("docs/gangs.md Job");
    job["metadata"]["name"] = json!(name);
    job["spec"]["parallelism"] = json!(workers);
    job["spec"]["completions"] = json!(workers);
    let pod = &mut job["spec"]["template"]["spec"];
    pod["containers"][0]["resources"] = json!({
        "requests": { "cpu": "1", "nvidia.com/gpu": gpus.to_string() },
        "limits": { "nvidia.com/gpu": gpus.to_string() },
    });
    if hold {
        pod["schedulingGates"] = json!([{ "name": HOLD }]);
    }
    job.to_string()
}

fn create_job(cp: &ControlPlane, manifest: &str) {
    let (ok, _, err) = cp.kubectl_as(&cp.admin_kubeconfig, &["create", "-f", "-"], Some(manifest));
    assert!(ok, "create the Job: {err}");
}

/// The live pods of Job `job`.
fn pods_of(cp: &ControlPlane, job: &str) -> Vec<Value> {
    cp.get_json(&format!(
        "/api/v1/namespaces/{NS}/pods?labelSelector=job-name%3D{job}"
    ))
    .and_then(|l| l["items"].as_array().cloned())
    .unwrap_or_default()
    .into_iter()
    .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
    .collect()
}

/// The pods' scheduling gates are only [`HOLD`]: Kueue's own topology gate is gone.
fn held_by_us_only(pod: &Value) -> bool {
    pod["spec"]["schedulingGates"]
        .as_array()
        .is_some_and(|g| g.len() == 1 && g[0]["name"] == HOLD)
}

/// Job `job`'s Workload once Kueue admitted it (our check `Ready`) with `workers` nodes
/// assigned, none of them in `avoid`.
fn wait_admitted(
    cp: &ControlPlane,
    controller: &Controller,
    job: &str,
    workers: usize,
    avoid: &[String],
) -> Value {
    let last = std::cell::RefCell::new(None);
    wait_until_ctx(
        &format!("{job} admitted on {workers} nodes, none of {avoid:?}"),
        Duration::from_secs(90),
        || {
            *last.borrow_mut() = workload_of(cp, job);
            last.borrow().as_ref().is_some_and(|w| {
                let on = assigned_nodes(w);
                condition_true(w, "Admitted")
                    && check_state(w).is_some_and(|(s, _)| s == "Ready")
                    && on.len() == workers
                    && on.iter().all(|n| !avoid.contains(n))
            })
        },
        || {
            format!(
                "\nworkload: {:#}\ncontroller:\n{}",
                last.borrow().clone().unwrap_or_default(),
                controller.log()
            )
        },
    );
    last.into_inner().expect("the Workload")
}

/// Node `name`'s port down: its agent marks it unvalidated. When the taint was seen.
fn fail(fleet: &Fleet, name: &str) -> Instant {
    let i = fleet.by_name(name);
    fleet.hcas[i].set_port(false);
    wait_until_ctx(
        &format!("{name} tainted"),
        Duration::from_secs(30),
        || fleet.nodes[i].has_our_taint(),
        String::new,
    );
    Instant::now()
}

/// When the watch first showed a `Retry` of our check whose message contains `needle`.
fn wait_retry(watch: &WorkloadWatch, needle: &str, controller: &Controller) -> Instant {
    wait_until_ctx(
        &format!("a Retry naming {needle}"),
        Duration::from_secs(60),
        || watch.retries().iter().any(|m| m.contains(needle)),
        || {
            format!(
                "\nretries: {:?}\ncontroller:\n{}",
                watch.retries(),
                controller.log()
            )
        },
    );
    Instant::now()
}

/// The notes of the Events `reason` on Workload `wl`.
fn events(cp: &ControlPlane, wl: &str, reason: &str) -> Vec<String> {
    ac::workload_events(cp, NS, wl)
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .map(|e| e["note"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// Workload `wl`'s Events of `reason` in `ns` once there is one: the controller writes the
/// Event right after the check's state, so it may land a moment after the state is seen.
/// Empty when none came within 15 s.
fn events_once_written(cp: &ControlPlane, ns: &str, wl: &str, reason: &str) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let found: Vec<Value> = ac::workload_events(cp, ns, wl)
            .into_iter()
            .filter(|e| e["reason"] == reason)
            .collect();
        if !found.is_empty() || start.elapsed() > Duration::from_secs(15) {
            return found;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// As [`events_once_written`] in the tests' namespace: the notes.
fn requeued_notes(cp: &ControlPlane, wl: &str) -> Vec<String> {
    events_once_written(cp, NS, wl, "FabricGangRequeued")
        .iter()
        .map(|e| e["note"].as_str().unwrap_or("").to_owned())
        .collect()
}

fn name_of(wl: &Value) -> String {
    wl["metadata"]["name"].as_str().unwrap_or("").to_owned()
}

/// `kubectl -n ml get kueueworkloads` and the gang's pods with their nodes, written to
/// `<target tmp>/kueue-output/{what}.txt` for docs/gangs.md; the first returned.
fn capture_get(cp: &ControlPlane, what: &str) -> String {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kueue-output");
    std::fs::create_dir_all(&dir).expect("mkdir kueue-output");
    let get = cp.kubectl(&["-n", NS, "get", "kueueworkloads"]);
    let columns = "custom-columns=POD:.metadata.name,NODE:.spec.nodeName,PHASE:.status.phase";
    let pods = cp.kubectl(&["-n", NS, "get", "pods", "-o", columns]);
    let text = format!(
        "$ kubectl -n {NS} get kueueworkloads\n{get}$ kubectl -n {NS} get pods -o {columns}\n{pods}"
    );
    std::fs::write(dir.join(format!("{what}.txt")), &text).expect("write");
    eprintln!("{what}:\n{text}");
    get
}

/// Workload `wl`'s `FabricGangRequeued` Events as `kubectl get events` lists them, written to
/// `<target tmp>/kueue-output/{what}.txt` for docs/gangs.md.
fn capture_events(cp: &ControlPlane, wl: &str, what: &str) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kueue-output");
    let columns = "custom-columns=REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message";
    let selector = format!("reason=FabricGangRequeued,involvedObject.name={wl}");
    let events = cp.kubectl(&[
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        &selector,
        "-o",
        columns,
    ]);
    let text =
        format!("$ kubectl -n {NS} get events --field-selector {selector} -o {columns}\n{events}");
    std::fs::write(dir.join(format!("{what}.txt")), &text).expect("write");
    assert!(events.contains("FabricGangRequeued"), "{text}");
}

/// Item 1 and the figure: a gang admitted on the 4 nodes of leaf a, its pods created but not
/// yet bound (held by a scheduling gate of the test). One member's port goes down: Kueue
/// v0.19's own TAS failed-node handling sees the taint at once and, with no spare node in the
/// leaf, evicts the gang itself (`NodeFailures`), well within the grace; fabricgate writes
/// nothing (no second requeue). Readmitted on leaf b, its pods bound there; then a member of
/// leaf b fails (leaf a repaired meanwhile): Kueue leaves a gang with bound pods alone, and
/// after the grace fabricgate's `Retry` names the node, Kueue evicts the gang whole and admits
/// it again on leaf a's 4 validated nodes. The Event and the metric say so.
#[test]
fn kueue_requeues_an_admitted_gang_whose_member_fails_and_readmits_it_on_validated_nodes() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    const GANG: usize = 4;
    let fleet = Fleet::up_sized(kueue, "kqq", 2, GANG);
    apply_queues(cp);
    let controller = Controller::start_with(kueue, &gang(GRACE, ""));
    wait_queue_active(kueue, &controller);
    create_job(cp, &gang_job(JOB, GANG, 8, true));
    let wl = wait_admitted(cp, &controller, JOB, GANG, &[]);
    let wl_name = name_of(&wl);
    let first = assigned_nodes(&wl);
    wait_until_ctx(
        "the gang's pods created, held by our gate only",
        Duration::from_secs(60),
        || {
            let pods = pods_of(cp, JOB);
            pods.len() == GANG && pods.iter().all(held_by_us_only)
        },
        || format!("\npods: {:#?}", pods_of(cp, JOB)),
    );
    assert!(bound_pods_of(cp, JOB).1.is_empty(), "no pod is bound yet");

    // Before its pods bind: Kueue's own node-failure handling, fabricgate not needed.
    let watch = WorkloadWatch::start(cp);
    let early = first[0].clone();
    let early_leaf = fleet.leaf_of(&early);
    fail(&fleet, &early);
    let wl = wait_admitted(cp, &controller, JOB, GANG, std::slice::from_ref(&early));
    let second = assigned_nodes(&wl);
    assert!(
        second.iter().all(|n| fleet.leaf_of(n) != early_leaf),
        "readmitted on the other leaf: {second:?} (first {first:?})"
    );
    let evicted: Vec<String> = watch
        .versions()
        .iter()
        .filter_map(|w| {
            w["status"]["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "Evicted" && c["status"] == "True")
                .map(|c| c["reason"].as_str().unwrap_or("").to_owned())
        })
        .collect();
    assert!(
        evicted.iter().all(|r| r == "NodeFailures") && !evicted.is_empty(),
        "Kueue evicted the unbound gang itself: {evicted:?}"
    );
    assert!(watch.retries().is_empty(), "{:?}", watch.retries());
    assert!(events(cp, &wl_name, "FabricGangRequeued").is_empty());
    assert_eq!(controller.metric(REQUEUED), 0.0);
    release_and_bind(cp, GANG, &second);
    mark_running(cp);
    drop(watch);

    // After they bind: fabricgate's requeue. Leaf a repaired first, so there is room.
    let i = fleet.by_name(&early);
    fleet.hcas[i].set_port(true);
    wait_until("validated again", Duration::from_secs(30), || {
        fleet.nodes[i].ready()
    });
    let before = capture_get(cp, "requeue-before");
    assert!(before.contains("True"), "admitted before: {before}");
    let watch = WorkloadWatch::start(cp);
    let failed = second[0].clone();
    let unvalidated = fail(&fleet, &failed);
    let retried = wait_retry(&watch, &failed, &controller);
    let took = retried.duration_since(unvalidated);
    eprintln!(
        "figure: member node unvalidated -> Retry written: {:.1} s (gang.requeue_grace {} s, \
         {GANG}-node gang, pods bound)",
        took.as_secs_f64(),
        GRACE.as_secs()
    );
    assert!(
        took + Duration::from_millis(500) >= GRACE,
        "requeued before the grace: {took:?}"
    );
    let retry = watch
        .retries()
        .into_iter()
        .find(|m| m.contains(&failed))
        .unwrap_or_default();
    assert!(
        retry.contains(
            "admitted gang requeued: 1 member is bad for longer than gang.requeue_grace 5s"
        ) && retry.contains(&format!("{failed}: FabricReady=False")),
        "{retry}"
    );
    // Evicted whole (its bound pods' end confirmed, as a kubelet would) and admitted again on
    // leaf a's validated nodes.
    wait_until_ctx(
        "the gang evicted: its Job suspended",
        Duration::from_secs(30),
        || crate::kueue::job_suspended(cp),
        || controller.log(),
    );
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            NS,
            "delete",
            "pods",
            "--all",
            "--grace-period=0",
            "--force",
        ],
        None,
    );
    let wl = wait_admitted(cp, &controller, JOB, GANG, std::slice::from_ref(&failed));
    let third = assigned_nodes(&wl);
    for n in &third {
        let node = &fleet.nodes[fleet.by_name(n)];
        assert!(
            fleet.leaf_of(n) == early_leaf && !node.has_our_taint(),
            "readmitted on leaf a's validated nodes: {third:?}"
        );
    }
    assert!(
        watch.versions().iter().any(|w| {
            w["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    c["type"] == "Evicted"
                        && c["status"] == "True"
                        && c["reason"] == "AdmissionCheck"
                })
            })
        }),
        "Kueue evicted the gang for the check"
    );
    release_and_bind(cp, GANG, &third);

    let requeued = requeued_notes(cp, &wl_name);
    assert!(
        requeued.len() == 1 && requeued[0].contains(&failed),
        "one FabricGangRequeued Event naming {failed}: {requeued:?}"
    );
    assert_eq!(controller.metric(REQUEUED), 1.0);
    let after = capture_get(cp, "requeue-after");
    assert!(after.contains("True"), "admitted after: {after}");
    capture_events(cp, &wl_name, "requeue-events");
    capture_output(kueue, "requeued");
    controller.kill();
}

/// The Job's pods `Running`, as their kubelet would report them.
fn mark_running(cp: &ControlPlane) {
    for p in pods_of(cp, JOB) {
        let name = p["metadata"]["name"].as_str().unwrap_or("").to_owned();
        cp.kubectl(&[
            "-n",
            NS,
            "patch",
            "pod",
            &name,
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"phase":"Running"}}"#,
        ]);
    }
}

/// The Job's live pods released from the test's gate as they appear, until `n` of them are
/// bound to exactly `on`.
fn release_and_bind(cp: &ControlPlane, n: usize, on: &[String]) {
    wait_until_ctx(
        "the pods released and bound to the assigned nodes",
        Duration::from_secs(60),
        || {
            for p in pods_of(cp, JOB) {
                if held_by_us_only(&p) {
                    let name = p["metadata"]["name"].as_str().unwrap_or("");
                    let _ = cp.kubectl_as(
                        &cp.admin_kubeconfig,
                        &[
                            "-n",
                            NS,
                            "patch",
                            "pod",
                            name,
                            "--type=merge",
                            "-p",
                            r#"{"spec":{"schedulingGates":null}}"#,
                        ],
                        None,
                    );
                }
            }
            let live: Vec<String> = {
                let mut v: Vec<String> = pods_of(cp, JOB)
                    .iter()
                    .filter_map(|p| p["spec"]["nodeName"].as_str().map(str::to_owned))
                    .collect();
                v.sort();
                v
            };
            live.len() == n && live == on
        },
        || format!("\npods: {:?}", bound_pods_of(cp, JOB)),
    );
}

/// Item 2: a gang running (pods bound, marked running as a kubelet would) whose member's port
/// flaps for less than the grace → nothing; down for good → `Retry` after the grace, the gang
/// evicted (the Job suspended).
#[test]
fn kueue_requeues_a_running_gang_after_the_grace_and_not_for_a_shorter_flap() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    // Longer here: the flap (taint, port back, validated again) must fit well inside it.
    let grace = Duration::from_secs(8);
    let fleet = Fleet::up(kueue, "kqf");
    apply_queues(cp);
    let controller = Controller::start_with(kueue, &gang(grace, ""));
    wait_queue_active(kueue, &controller);
    create_job(cp, &gang_job(JOB, WORKERS, 8, false));
    let on = wait_admitted_and_bound(kueue, &controller);
    mark_running(cp);
    let wl = name_of(&workload_of(cp, JOB).expect("the Workload"));
    let watch = WorkloadWatch::start(cp);
    let member = on[1].clone();
    let i = fleet.by_name(&member);

    // A flap: down, then validated again within the grace.
    let down = fail(&fleet, &member);
    fleet.hcas[i].set_port(true);
    wait_until("validated again", Duration::from_secs(30), || {
        fleet.nodes[i].ready()
    });
    let flap = down.elapsed();
    assert!(
        flap + Duration::from_secs(2) < grace,
        "the flap ({flap:?}) must be shorter than the grace for this test to say anything"
    );
    std::thread::sleep(
        (down + grace + Duration::from_secs(2)).saturating_duration_since(Instant::now()),
    );
    assert!(
        watch.retries().is_empty(),
        "a flap shorter than the grace requeued: {:?}",
        watch.retries()
    );
    assert!(events(cp, &wl, "FabricGangRequeued").is_empty());
    let now = workload_of(cp, JOB).expect("the Workload");
    assert!(condition_true(&now, "Admitted"), "{now:#}");
    assert_eq!(bound_pods_of(cp, JOB).1, on, "the gang keeps running");
    assert_eq!(controller.metric(REQUEUED), 0.0);

    // Down for good: requeued once the grace is over.
    let down = fail(&fleet, &member);
    let retried = wait_retry(&watch, &member, &controller);
    let took = retried.duration_since(down);
    eprintln!(
        "figure: member node unvalidated -> Retry written: {:.1} s (gang.requeue_grace {} s, \
         {WORKERS}-node gang, pods bound)",
        took.as_secs_f64(),
        grace.as_secs()
    );
    assert!(
        took + Duration::from_millis(500) >= grace,
        "requeued before the grace: {took:?}"
    );
    wait_until_ctx(
        "the gang evicted: its Job suspended",
        Duration::from_secs(30),
        || crate::kueue::job_suspended(cp),
        || controller.log(),
    );
    let requeued = requeued_notes(cp, &wl);
    assert!(
        requeued.len() == 1 && requeued[0].contains(&member),
        "one FabricGangRequeued Event naming {member}: {requeued:?}"
    );
    assert_eq!(controller.metric(REQUEUED), 1.0);
    controller.kill();
}

/// Item 3: a member pod whose agent found it on sockets (the pod condition
/// `fabricgate.io/TransportReady=False`, reason `SocketsFallback`, written through pods/status
/// with that node's agent token, as the agent writes it) → `Retry` after the grace naming the
/// pod; its node stays validated.
#[test]
fn kueue_requeues_a_gang_whose_member_pod_is_on_sockets() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let fleet = Fleet::up(kueue, "kqs");
    apply_queues(cp);
    let controller = Controller::start_with(kueue, &gang(GRACE, ""));
    wait_queue_active(kueue, &controller);
    create_job(cp, &gang_job(JOB, WORKERS, 8, false));
    let on = wait_admitted_and_bound(kueue, &controller);
    let wl = name_of(&workload_of(cp, JOB).expect("the Workload"));
    let node = on[0].clone();
    let pod = pods_of(cp, JOB)
        .into_iter()
        .find(|p| p["spec"]["nodeName"] == node.as_str())
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .expect("a pod on the first node");
    // The runtime-transport overlay grants the agent pods/status (its own node's pods, its own
    // condition only: the overlay's admission policy); taken back at the end (other tests
    // assert the base's grants).
    let _widened = crate::common::controlplane::WidenedRbac::apply(cp);
    let path = crate::common::repo_root()
        .join("deploy/overlays/runtime-transport")
        .join("pod-transport-policy.yaml");
    cp.apply(&std::fs::read_to_string(&path).expect("read the runtime-transport overlay"));
    let watch = WorkloadWatch::start(cp);
    let agent = fleet.nodes[fleet.by_name(&node)].agent_kubeconfig(None);
    let condition = json!({ "status": { "conditions": [{
        "type": "fabricgate.io/TransportReady", "status": "False", "reason": "SocketsFallback",
        "message": "NCCL_NET=Socket: no RDMA device in the pod",
        "lastTransitionTime": "2026-12-05T00:00:00Z" }] } });
    // The agent's own request (`transport::writer`: a strategic merge patch of pods/status, no
    // GET first), retried while the apiserver has not yet loaded the overlay's grants.
    let err = std::cell::RefCell::new(String::new());
    wait_until_ctx(
        &format!("the agent of {node} sets its pod's condition"),
        Duration::from_secs(20),
        || match crate::runtime_transport::patch_as_agent(cp, &agent, NS, &pod, &condition) {
            Ok(()) => true,
            Err(e) => {
                *err.borrow_mut() = e;
                false
            }
        },
        || err.borrow().clone(),
    );
    let set = Instant::now();
    let retried = wait_retry(&watch, &pod, &controller);
    assert!(
        retried.duration_since(set) + Duration::from_millis(500) >= GRACE,
        "requeued before the grace"
    );
    let retry = watch
        .retries()
        .into_iter()
        .find(|m| m.contains(&pod))
        .unwrap_or_default();
    assert!(
        retry.contains(&format!(
            "pod {NS}/{pod} on {node}: fabricgate.io/TransportReady=False (SocketsFallback"
        )),
        "{retry}"
    );
    requeued_once_for(cp, &wl, &pod, &controller, &fleet, &node);
    controller.kill();
}

/// The gang requeued once for `pod` (one `FabricGangRequeued` Event naming it, the metric at
/// 1), and `node`, the pod's, still validated: the pod was the cause, not its node.
fn requeued_once_for(
    cp: &ControlPlane,
    wl: &str,
    pod: &str,
    controller: &Controller,
    fleet: &Fleet,
    node: &str,
) {
    let requeued = requeued_notes(cp, wl);
    assert!(
        requeued.len() == 1 && requeued[0].contains(pod),
        "one FabricGangRequeued Event naming {pod}: {requeued:?}"
    );
    assert_eq!(controller.metric(REQUEUED), 1.0);
    assert!(
        !fleet.nodes[fleet.by_name(node)].has_our_taint(),
        "the node itself stays validated"
    );
}

/// `fabricgate.io/TransportReady` of pod `pod` in the Job's namespace as
/// `status/reason: message`.
fn transport_condition(cp: &ControlPlane, pod: &str) -> Option<String> {
    crate::runtime_transport::transport_condition(cp, NS, pod)
}

/// The converse of `kueue_requeues_a_gang_whose_member_pod_is_on_sockets`: real agents with
/// runtime transport (`runtime.confirm_windows: 2`, window 5 s, the pod facts through the test
/// seam) judge the pods of an admitted, running gang. One member shows one window of bulk TCP, then is quiet
/// (a checkpoint restore, a peer streaming into its TCPStore): its condition says "on sockets
/// for 1 of 2 windows" and never turns `False`, so past the grace and three windows more the
/// gang stays admitted: no `Retry`, no `FabricGangRequeued` Event, `requeued` 0. Then two
/// windows in a row on sockets: `False`, and the gang is requeued after the grace (the same
/// setup can requeue).
#[test]
fn kueue_does_not_requeue_a_gang_whose_member_shows_one_unconfirmed_window_of_sockets() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    const WINDOW: Duration = Duration::from_secs(5);
    // The agents read pods and write their condition from their first window: the
    // runtime-transport overlay's grants and policy before they start.
    cp.install_agent_rbac();
    let _widened = crate::common::controlplane::WidenedRbac::apply(cp);
    let path = crate::common::repo_root()
        .join("deploy/overlays/runtime-transport")
        .join("pod-transport-policy.yaml");
    cp.apply(&std::fs::read_to_string(&path).expect("read the runtime-transport overlay"));
    let dir = tempfile::tempdir().expect("tempdir");
    let facts = dir.path().join("pod-facts");
    std::fs::write(&facts, "").expect("write the facts");
    let runtime = format!(
        "runtime:\n  enabled: true\n  window: {}s\n  confirm_windows: 2\n  \
         pod_selector: \"batch.kubernetes.io/job-name={JOB}\"\n",
        WINDOW.as_secs()
    );
    let seam = facts.to_str().expect("a UTF-8 path").to_owned();
    let fleet = Fleet::up_with(
        kueue,
        "kqw",
        1,
        WORKERS,
        &runtime,
        &[("FABRICGATE_TEST_POD_FACTS", seam.as_str())],
    );
    apply_queues(cp);
    let controller = Controller::start_with(kueue, &gang(GRACE, ""));
    wait_queue_active(kueue, &controller);
    create_job(cp, &gang_job(JOB, WORKERS, 8, false));
    let on = wait_admitted_and_bound(kueue, &controller);
    mark_running(cp);
    let wl = name_of(&workload_of(cp, JOB).expect("the Workload"));
    let pods = pods_of(cp, JOB);
    let field = |p: &Value, f: &str| p["metadata"][f].as_str().unwrap_or("").to_owned();
    let member = pods
        .iter()
        .find(|p| p["spec"]["nodeName"] == on[0].as_str())
        .expect("a pod on the first node");
    let (pod, uid) = (field(member, "name"), field(member, "uid"));
    // The other members on RDMA throughout.
    let others: String = pods
        .iter()
        .filter(|p| field(p, "uid") != uid)
        .map(|p| format!("{} rdma mlx5_0\n", field(p, "uid")))
        .collect();
    let set_member = |line: &str| {
        std::fs::write(&facts, format!("{others}{uid} {line}\n")).expect("write the facts");
    };
    let watch = WorkloadWatch::start(cp);
    let seen = std::cell::RefCell::new(Vec::<String>::new());
    let record = || {
        let now = transport_condition(cp, &pod).unwrap_or_default();
        assert!(
            !now.starts_with("False/"),
            "turned False on one window: {now}\ncontroller:\n{}",
            controller.log()
        );
        let mut seen = seen.borrow_mut();
        if seen.last() != Some(&now) {
            seen.push(now);
        }
    };

    // One window of bulk TCP with a peer, then quiet.
    set_member("sockets 41000000000 10.0.0.2 eth0");
    wait_until_ctx(
        "the member's first window: sockets, not yet confirmed",
        Duration::from_secs(30),
        || {
            record();
            transport_condition(cp, &pod)
                .is_some_and(|m| m.contains("on sockets for 1 of 2 windows"))
        },
        || format!("\nconditions seen: {:?}", seen.borrow()),
    );
    set_member("sockets 0 10.0.0.2 eth0");
    let unconfirmed = Instant::now();
    // Past the grace and three windows more: the gang stays as it was.
    let until = unconfirmed + GRACE + 3 * WINDOW;
    while Instant::now() < until {
        record();
        assert!(
            watch.retries().is_empty(),
            "requeued on one window: {:?}",
            watch.retries()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let shown = seen.borrow().clone();
    assert!(
        shown
            .iter()
            .any(|m| m.starts_with("Unknown/NoInterNodeTraffic: ")
                && m.contains("on sockets for 1 of 2 windows")),
        "{shown:?}"
    );
    assert!(events(cp, &wl, "FabricGangRequeued").is_empty());
    assert_eq!(controller.metric(REQUEUED), 0.0);
    let now = workload_of(cp, JOB).expect("the Workload");
    assert!(condition_true(&now, "Admitted"), "{now:#}");
    assert_eq!(check_state(&now).map(|s| s.0).as_deref(), Some("Ready"));
    assert_eq!(bound_pods_of(cp, JOB).1, on, "the gang keeps running");
    assert!(!crate::kueue::job_suspended(cp));

    // Two windows in a row: confirmed, `False`, and requeued after the grace.
    set_member("sockets 41000000000 10.0.0.2 eth0");
    wait_until_ctx(
        "the member's condition False/SocketsFallback",
        Duration::from_secs(30),
        || transport_condition(cp, &pod).is_some_and(|m| m.starts_with("False/SocketsFallback")),
        || format!("\n{:?}", transport_condition(cp, &pod)),
    );
    let set = Instant::now();
    let retried = wait_retry(&watch, &pod, &controller);
    assert!(
        retried.duration_since(set) + Duration::from_millis(500) >= GRACE,
        "requeued before the grace"
    );
    requeued_once_for(cp, &wl, &pod, &controller, &fleet, &on[0]);
    controller.kill();
}

/// Item 4: `GANGS` one-pod gangs on a pool of two Nodes whose ports all go down at once.
/// `gang.after_admission: ignore` → nothing requeued; then with `requeue` and
/// `gang.max_requeues_per_window` `MAX` → exactly `MAX` requeued, the rest held (one
/// `FabricGangRequeueHeld` Event each, the metrics), every Workload still there. (The issue's
/// 20 gangs with a maximum of 10, scaled down to 6 with 3 for a 2-core CI runner.)
#[test]
fn kueue_breaker_holds_a_fleet_wide_requeue_and_ignore_requeues_nothing() {
    const GANGS: usize = 6;
    const MAX: usize = 3;
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let grace = Duration::from_secs(3);
    let fleet = Fleet::up_sized(kueue, "kqk", 1, 2);
    apply_queues(cp);
    let ignore = Controller::start_with(kueue, &gang(grace, "  after_admission: ignore\n"));
    wait_queue_active(kueue, &ignore);
    let jobs: Vec<String> = (0..GANGS).map(|g| format!("{JOB}-{g}")).collect();
    for job in &jobs {
        create_job(cp, &gang_job(job, 1, 1, false));
    }
    let mut names = BTreeSet::new();
    for job in &jobs {
        names.insert(name_of(&wait_admitted(cp, &ignore, job, 1, &[])));
    }
    let watch = WorkloadWatch::start(cp);
    for n in &fleet.nodes {
        fleet.hcas[fleet.by_name(&n.name)].set_port(false);
    }
    for n in &fleet.nodes {
        fail(&fleet, &n.name);
    }
    std::thread::sleep(grace + Duration::from_secs(3));
    assert!(
        watch.retries().is_empty(),
        "gang.after_admission: ignore requeued: {:?}",
        watch.retries()
    );
    for job in &jobs {
        let wl = workload_of(cp, job).expect("the Workload");
        assert!(condition_true(&wl, "Admitted"), "{wl:#}");
    }
    assert_eq!(ignore.metric(REQUEUED), 0.0);
    ignore.kill();

    let c = Controller::start_with(
        kueue,
        &gang(grace, &format!("  max_requeues_per_window: {MAX}\n")),
    );
    let all_events = |reason: &str| -> Vec<(String, String)> {
        names
            .iter()
            .flat_map(|n| events(cp, n, reason).into_iter().map(|e| (n.clone(), e)))
            .collect()
    };
    wait_until_ctx(
        "MAX gangs requeued, the rest held",
        Duration::from_secs(60),
        || {
            all_events("FabricGangRequeued").len() == MAX
                && all_events("FabricGangRequeueHeld").len() == GANGS - MAX
        },
        || {
            format!(
                "\nrequeued: {:?}\nheld: {:?}\ncontroller:\n{}",
                all_events("FabricGangRequeued"),
                all_events("FabricGangRequeueHeld"),
                c.log()
            )
        },
    );
    // A pass or two later: still no more than MAX.
    std::thread::sleep(Duration::from_secs(2));
    let requeued: BTreeSet<String> = all_events("FabricGangRequeued")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let held = all_events("FabricGangRequeueHeld");
    let held_names: BTreeSet<String> = held.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(requeued.len(), MAX, "{requeued:?}");
    assert_eq!(held.len(), GANGS - MAX, "one Event per held gang: {held:?}");
    assert!(requeued.is_disjoint(&held_names));
    assert_eq!(
        requeued
            .union(&held_names)
            .cloned()
            .collect::<BTreeSet<_>>(),
        names,
        "every gang is requeued or reported held"
    );
    for (_, note) in &held {
        assert!(
            note.starts_with("BreakerOpen: breaker open, not requeueing: 3 admitted gangs")
                && note.contains("gang.max_requeues_per_window 3")
                && note.contains("would requeue: admitted gang requeued"),
            "{note}"
        );
    }
    let retried: BTreeSet<String> = watch
        .versions()
        .iter()
        .filter(|w| check_state(w).is_some_and(|(s, _)| s == "Retry"))
        .map(name_of)
        .collect();
    assert_eq!(retried, requeued, "a Retry only on the requeued gangs");
    assert_eq!(c.metric(REQUEUED), MAX as f64);
    assert_eq!(
        c.metric("fabricgate_gang_requeues_held_total"),
        (GANGS - MAX) as f64
    );
    assert_eq!(c.metric("fabricgate_gang_requeue_breaker_open"), 1.0);
    // Nothing lost: every Workload still there and active; the held ones still admitted.
    for job in &jobs {
        let wl = workload_of(cp, job).expect("every Workload stays");
        assert_ne!(wl["spec"]["active"], Value::Bool(false), "{wl:#}");
        if held_names.contains(&name_of(&wl)) {
            // Held by our breaker, it stays admitted, unless Kueue's own node-failure
            // handling (TAS: no replacement for an unhealthy node) evicted it meanwhile,
            // which the check does not decide (no Retry of ours: asserted above).
            let kueue_evicted = wl["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Evicted" && c["reason"] == "NodeFailures");
            assert!(
                condition_true(&wl, "Admitted") || kueue_evicted,
                "held stays admitted: {wl:#}"
            );
        }
    }
    c.kill();
}

/// A Workload of ours in `ns` admitted by hand (quota reserved, our check `Ready`, as Kueue
/// leaves it), of `pods` pods; `nodes`: its topology assignment (`None`: none).
fn admit_by_hand(cp: &ControlPlane, ns: &str, name: &str, pods: usize, nodes: Option<&[&str]>) {
    ac::create_workload(cp, ns, name, pods);
    let when = "2026-12-05T00:00:00Z";
    let mut psa = json!({ "name": "main", "flavors": { "cpu": "gpu" }, "count": pods,
                          "resourceUsage": { "cpu": pods.to_string() } });
    if let Some(nodes) = nodes {
        psa["topologyAssignment"] = json!({
            "levels": ["kubernetes.io/hostname"],
            "slices": [{ "domainCount": nodes.len(),
                "valuesPerLevel": [{ "individual": { "roots": nodes } }],
                "podCounts": { "universal": 1 } }] });
    }
    let body = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": name, "namespace": ns },
        "status": {
            "conditions": [
                { "type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                  "message": "Quota reserved in ClusterQueue gpu", "lastTransitionTime": when },
                { "type": "Admitted", "status": "True", "reason": "Admitted",
                  "message": "The workload is admitted", "lastTransitionTime": when }],
            "admission": { "clusterQueue": "gpu", "podSetAssignments": [psa] },
            "admissionChecks": [{ "name": ac::CHECK, "state": "Ready",
                "message": "gang RDMA pre-flight passed", "lastTransitionTime": when }],
        },
    });
    cp.block_on(ac::workloads(cp, ns).patch_status(
        name,
        &kube::api::PatchParams::apply("kueue-admission").force(),
        &kube::api::Patch::Apply(&body),
    ))
    .unwrap_or_else(|e| panic!("admit {ns}/{name}: {e}"));
}

/// The controller for the bad-input tests: a short grace, serving only `ns`.
fn bad_input_controller(env: &ac::Env, ns: &str) -> ac::Controller {
    let config = ac::config_with(
        env,
        ns,
        "5s",
        &format!("  requeue_grace: {}s\n", GRACE.as_secs()),
    );
    ac::start(env, ns, &format!("{ns}-lease"), ns, &config)
}

/// Bad input 1: an admitted Workload without a topology assignment (Kueue without TAS). Its
/// members are the nodes its pods are bound to: with all of them validated it stays `Ready`;
/// once one is not, `Retry` after the grace naming it. Without any pod it has no member and
/// is left alone.
#[test]
fn kueue_requeue_without_topology_judges_the_nodes_its_pods_are_bound_to() {
    let Some(env) = ac::setup() else { return };
    let cp = env.cp;
    let ns = "rq-notas";
    ac::gpu_node(cp, "rq-notas-0", "leaf-rq", true);
    ac::gpu_node(cp, "rq-notas-1", "leaf-rq", true);
    let c = bad_input_controller(&env, ns);
    admit_by_hand(cp, ns, "podless", 1, None);
    admit_by_hand(cp, ns, "gang", 1, None);
    cp.create_namespace(ns);
    // Its pod, as Kueue's Job integration labels and annotates it, bound to rq-notas-1.
    cp.apply(
        &json!({ "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "gang-0", "namespace": ns,
                "labels": { "kueue.x-k8s.io/podset": "main" },
                "annotations": { "kueue.x-k8s.io/workload": "gang" } },
            "spec": { "nodeName": "rq-notas-1", "containers": [{ "name": "worker",
                "image": "registry.example.com/train:1" }] } })
        .to_string(),
    );
    // Good members: nothing happens within a grace and more.
    std::thread::sleep(GRACE + Duration::from_secs(1));
    assert_eq!(ac::check_state(cp, ns, "gang").0, "Ready");
    ac::set_fabric(cp, "rq-notas-1", false);
    let bad = Instant::now();
    c.wait("Retry", Duration::from_secs(30), || {
        ac::check_state(cp, ns, "gang").0 == "Retry"
    });
    assert!(bad.elapsed() + Duration::from_millis(500) >= GRACE);
    let (_, message) = ac::check_state(cp, ns, "gang");
    assert!(
        message.contains("rq-notas-1: FabricReady=False (RdmaPortDown"),
        "{message}"
    );
    // The pod-less one has no member to judge: left Ready.
    assert_eq!(ac::check_state(cp, ns, "podless").0, "Ready");
    assert_eq!(c.metric(REQUEUED), 1.0);
    let _ = cp.kubectl(&[
        "-n",
        ns,
        "delete",
        "pod",
        "gang-0",
        "--grace-period=0",
        "--force",
    ]);
    for n in ["rq-notas-0", "rq-notas-1"] {
        let _ = cp.kubectl(&["delete", "node", n, "--wait=false"]);
    }
}

/// Bad input 2: an admitted gang one of whose Nodes was deleted → `Retry` after the grace,
/// saying the Node is gone.
#[test]
fn kueue_requeue_a_gang_whose_node_was_deleted_is_requeued() {
    let Some(env) = ac::setup() else { return };
    let cp = env.cp;
    let ns = "rq-gone";
    ac::gpu_node(cp, "rq-gone-0", "leaf-rg", true);
    ac::gpu_node(cp, "rq-gone-1", "leaf-rg", true);
    let c = bad_input_controller(&env, ns);
    admit_by_hand(cp, ns, "gang", 2, Some(&["rq-gone-0", "rq-gone-1"]));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(ac::check_state(cp, ns, "gang").0, "Ready");
    cp.kubectl(&["delete", "node", "rq-gone-1"]);
    let gone = Instant::now();
    c.wait("Retry", Duration::from_secs(30), || {
        ac::check_state(cp, ns, "gang").0 == "Retry"
    });
    assert!(gone.elapsed() + Duration::from_millis(500) >= GRACE);
    let (_, message) = ac::check_state(cp, ns, "gang");
    assert!(message.contains("rq-gone-1: the Node is gone"), "{message}");
    assert!(!message.contains("rq-gone-0"), "{message}");
    let events = events_once_written(cp, ns, "gang", "FabricGangRequeued");
    assert!(
        events
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|n| n.contains("rq-gone-1"))),
        "{events:?}"
    );
    let _ = cp.kubectl(&["delete", "node", "rq-gone-0", "--wait=false"]);
}

/// Bad input 3: the check's state edited by hand. A `Retry` of ours turned back into `Ready`
/// by a user while the member is still bad is not trusted: it is judged again and set `Retry`
/// after a new grace (a state outside Kueue's four the API itself refuses).
#[test]
fn kueue_requeue_a_check_state_edited_by_hand_is_judged_again() {
    let Some(env) = ac::setup() else { return };
    let cp = env.cp;
    let ns = "rq-edit";
    ac::gpu_node(cp, "rq-edit-0", "leaf-re", true);
    ac::gpu_node(cp, "rq-edit-1", "leaf-re", false);
    let c = bad_input_controller(&env, ns);
    admit_by_hand(cp, ns, "gang", 2, Some(&["rq-edit-0", "rq-edit-1"]));
    c.wait("Retry", Duration::from_secs(30), || {
        ac::check_state(cp, ns, "gang").0 == "Retry"
    });
    // The user's edit: back to Ready (as with `kubectl edit --subresource=status`).
    let edit = |state: &str| {
        let mut wl = cp
            .get_json(&format!(
                "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/gang"
            ))
            .expect("the Workload");
        wl["status"]["admissionChecks"][0]["state"] = json!(state);
        wl["status"]["admissionChecks"][0]["message"] = json!("edited by hand");
        let (ok, _, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["replace", "--subresource=status", "-f", "-"],
            Some(&wl.to_string()),
        );
        assert!(ok, "edit the check state: {err}");
        Instant::now()
    };
    let edited = edit("Ready");
    c.wait("Retry again", Duration::from_secs(30), || {
        ac::check_state(cp, ns, "gang").0 == "Retry"
    });
    assert!(edited.elapsed() + Duration::from_millis(500) >= GRACE);
    let (_, message) = ac::check_state(cp, ns, "gang");
    assert!(
        message.contains("rq-edit-1: FabricReady=False"),
        "{message}"
    );
    assert_eq!(c.metric(REQUEUED), 2.0);
    for n in ["rq-edit-0", "rq-edit-1"] {
        let _ = cp.kubectl(&["delete", "node", n, "--wait=false"]);
    }
}

/// One tenant's gangs spent every requeue of the window, and a new leader forgot the count:
/// three admitted gangs of one namespace lose their Nodes at once, with
/// `gang.max_requeues_per_namespace: 2` (and the global limit far off). Two are requeued, the
/// third is held (`FabricGangRequeueHeld`), and the count is on the controller's Lease
/// (`fabricgate.io/requeues`). The leader is killed; the next one reads the count back and
/// holds the third still, past the grace. Before: all three requeued at once (no limit per
/// namespace), and a new leader started counting from none.
#[test]
fn redteam_one_tenant_spends_only_its_share_of_requeues_and_a_new_leader_keeps_the_count() {
    let Some(env) = ac::setup() else { return };
    let cp = env.cp;
    let ns = "rq-tenant";
    let lease = "rq-tenant-lease";
    let nodes: Vec<String> = (0..3).map(|i| format!("rq-tenant-{i}")).collect();
    for n in &nodes {
        ac::gpu_node(cp, n, "leaf-rt", true);
    }
    let config = ac::config_with(
        &env,
        ns,
        "5s",
        &format!(
            "  requeue_grace: {}s\n  max_requeues_per_namespace: 2\n",
            GRACE.as_secs()
        ),
    );
    // A new installation: no count left by an earlier run on this control plane.
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            "fabricgate",
            "delete",
            "lease",
            lease,
            "--ignore-not-found",
        ],
        None,
    );
    let first = ac::start(&env, "rq-tenant-a", lease, ns, &config);
    let gangs: Vec<String> = (0..3).map(|i| format!("gang-{i}")).collect();
    for (gang, node) in gangs.iter().zip(&nodes) {
        admit_by_hand(cp, ns, gang, 1, Some(&[node.as_str()]));
    }
    std::thread::sleep(Duration::from_secs(1));
    for gang in &gangs {
        assert_eq!(ac::check_state(cp, ns, gang).0, "Ready");
    }
    for n in &nodes {
        cp.kubectl(&["delete", "node", n, "--wait=false"]);
    }
    let events = |wl: &str, reason: &str| -> Vec<String> {
        ac::workload_events(cp, ns, wl)
            .into_iter()
            .filter(|e| e["reason"] == reason)
            .map(|e| e["note"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    let retried = || {
        gangs
            .iter()
            .filter(|g| ac::check_state(cp, ns, g).0 == "Retry")
            .cloned()
            .collect::<Vec<String>>()
    };
    first.wait(
        "two requeued, the third held",
        Duration::from_secs(30),
        || {
            retried().len() == 2
                && gangs
                    .iter()
                    .any(|g| !events(g, "FabricGangRequeueHeld").is_empty())
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    let requeued = retried();
    assert_eq!(requeued.len(), 2, "{requeued:?}\n{}", first.log());
    let held = gangs
        .iter()
        .find(|g| !requeued.contains(g))
        .cloned()
        .unwrap();
    let note = events(&held, "FabricGangRequeueHeld").join("\n");
    assert!(
        note.contains("2 admitted gangs of namespace rq-tenant")
            && note.contains("gang.max_requeues_per_namespace 2"),
        "{note}"
    );
    let published = || {
        cp.get_json(&format!(
            "/apis/coordination.k8s.io/v1/namespaces/fabricgate/leases/{lease}"
        ))
        .and_then(|l| {
            l["metadata"]["annotations"]["fabricgate.io/requeues"]
                .as_str()
                .and_then(|t| serde_json::from_str::<Value>(t).ok())
        })
    };
    first.wait("the count on the Lease", Duration::from_secs(10), || {
        published().is_some_and(|p| p["requeues"].as_array().is_some_and(|r| r.len() == 2))
    });

    // The leader dies (no release: its Lease runs out); the next reads the count back.
    drop(first);
    let second = ac::start(&env, "rq-tenant-b", lease, ns, &config);
    second.wait("the count read back", Duration::from_secs(20), || {
        second
            .log()
            .contains("the requeue breaker's count read from the Lease")
    });
    std::thread::sleep(GRACE + Duration::from_secs(3));
    assert_eq!(
        ac::check_state(cp, ns, &held).0,
        "Ready",
        "a new leader requeued the held gang:\n{}",
        second.log()
    );
    assert_eq!(retried().len(), 2);
}
