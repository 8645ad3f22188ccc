//! The plan: pure, from the Node as read and the verdict.

use super::{KEY, applied, node, taint, verdict};
use crate::node::{FIELD_MANAGER, owned_labels, plan};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

#[test]
fn keep_taint_leaves_our_taint_either_way_and_agent_error_is_one_transition() {
    let now = Timestamp::now();
    let mut v = verdict(false);
    v.keep_taint = true;
    for taints in [vec![], vec![taint(KEY)]] {
        let n = node(&[], taints, vec![]);
        assert_eq!(plan(&n, &v, KEY, &now).taints, None);
    }
    // Not ready for a port, then an agent error: still False, but an Event is due once.
    let before = verdict(false);
    let n = node(&[], vec![taint(KEY)], applied(&before, &now));
    let mut v = verdict(false);
    for c in &mut v.conditions {
        c.reason = crate::policy::agent_fault::REASON.into();
    }
    let p = plan(&n, &v, KEY, &now);
    assert_eq!(
        p.transition.map(|t| t.reason),
        Some(crate::policy::agent_fault::REASON.to_owned())
    );
    let n = node(&[], vec![taint(KEY)], applied(&v, &now));
    assert_eq!(plan(&n, &v, KEY, &now).transition, None, "only on entering");
}

#[test]
fn a_node_that_matches_needs_no_write() {
    let now = Timestamp::now();
    let v = verdict(false);
    let n = node(
        &[("fabricgate.io/ready", "false"), ("team", "ml")],
        vec![taint("other"), taint(KEY)],
        applied(&v, &now),
    );
    let p = plan(&n, &v, KEY, &now);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(p.transition, None);
}

#[test]
fn tainting_keeps_other_taints_in_place_and_untainting_removes_only_ours() {
    let now = Timestamp::now();
    let n = node(&[], vec![taint("a"), taint("b")], vec![]);
    let t = plan(&n, &verdict(false), KEY, &now).taints.unwrap();
    let keys: Vec<&str> = t.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(keys, ["a", "b", KEY]);

    let n = node(
        &[],
        vec![taint("a"), taint(KEY), taint("b"), taint(KEY)],
        vec![],
    );
    let t = plan(&n, &verdict(true), KEY, &now).taints.unwrap();
    let keys: Vec<&str> = t.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);

    // Our key with the wrong effect is replaced where it stands.
    let mut wrong = taint(KEY);
    wrong.effect = "NoExecute".into();
    let n = node(&[], vec![taint("a"), wrong, taint("b")], vec![]);
    let t = plan(&n, &verdict(false), KEY, &now).taints.unwrap();
    assert_eq!(t[1].key, KEY);
    assert_eq!(t[1].effect, "NoSchedule");
    assert_eq!(t.len(), 3);
}

#[test]
fn last_transition_time_changes_only_with_the_status() {
    let then = Timestamp::from_second(1_700_000_000).unwrap();
    let now = Timestamp::now();
    let bad = verdict(false);
    let mut observed = applied(&bad, &then);
    // Same status, new message: rewritten, transition time kept.
    observed[0].message = Some("older message".into());
    let p = plan(&node(&[], vec![], observed.clone()), &bad, KEY, &now);
    let c = p.conditions.unwrap();
    assert_eq!(c[0].last_transition_time, Some(Time(then)));
    assert_eq!(p.transition, None, "no status change, no event");
    // Status flips: new transition time and an event.
    let p = plan(&node(&[], vec![], observed), &verdict(true), KEY, &now);
    let c = p.conditions.unwrap();
    assert_eq!(c[0].last_transition_time, Some(Time(now)));
    assert!(p.transition.unwrap().ready);
}

#[test]
fn labels_we_owned_and_no_longer_set_trigger_an_apply() {
    let now = Timestamp::now();
    let v = verdict(true);
    let mut n = node(
        &[
            ("fabricgate.io/ready", "true"),
            ("fabricgate.io/rdma.rate-gbps", "400"),
        ],
        vec![],
        applied(&v, &now),
    );
    // Not ours (no managed fields): left alone.
    assert!(plan(&n, &v, KEY, &now).labels.is_none());
    n.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
        manager: Some(FIELD_MANAGER.into()),
        operation: Some("Apply".into()),
        fields_v1: Some(FieldsV1(json!({"f:metadata": {"f:labels": {
            "f:fabricgate.io/ready": {}, "f:fabricgate.io/rdma.rate-gbps": {}
        }}}))),
        ..ManagedFieldsEntry::default()
    }]);
    assert_eq!(
        owned_labels(&n),
        [
            "fabricgate.io/rdma.rate-gbps".to_owned(),
            "fabricgate.io/ready".to_owned()
        ]
        .into()
    );
    assert_eq!(plan(&n, &v, KEY, &now).labels, Some(v.labels.clone()));
}
