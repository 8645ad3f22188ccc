//! The rules out: this node's `DeviceTaintRule`s kept equal to the verdicts' device taints
//! ([`DeviceTaintRules`]), and the writer's state mirrored into a metric ([`follow_state`]).

use super::assess::RulesState;
use super::common::{is_not_served, sleep_until_opt};
use super::metrics::DraMetrics;
use super::settings::DeviceTaintEffect;
use crate::node::FIELD_MANAGER;
use crate::node::FIRST_BACKOFF;
use crate::node::WATCH_TIMEOUT_SECS;
use crate::node::WatchBackoff;
use crate::observe::metrics::Metrics;
use crate::policy::Verdict;
use crate::policy::devices::DeviceTaint;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::DeviceTaintRule;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The label on every rule an agent keeps, its node's name (or `fnv-<hash>` when the name is
/// not a label value): what its watch selects. The rule's own `spec.deviceSelector.pool` is
/// what counts; the admission policy ties it to the agent's token.
pub const NODE_LABEL: &str = "fabricgate.io/node";
/// The HCA a rule is about, and the probe's message, for `kubectl get devicetaintrules -o yaml`.
pub const HCA_ANNOTATION: &str = "fabricgate.io/hca";
pub const MESSAGE_ANNOTATION: &str = "fabricgate.io/message";
/// Every rule's plain name starts with this (the admission policy checks the whole name).
pub const RULE_PREFIX: &str = "fabricgate-";
/// The alternative name's prefix: no plain name starts with it.
pub const ALT_RULE_PREFIX: &str = "fabricgate.";
/// The longest object name the API takes (a DNS subdomain).
const MAX_NAME: usize = 253;

/// [`NODE_LABEL`]'s value for `node`.
pub fn node_label_value(node: &str) -> String {
    if !node.is_empty() && node.len() <= 63 {
        node.to_owned()
    } else {
        format!("fnv-{:016x}", crate::text::fnv64(node))
    }
}

/// The rule's plain name for a device of `node`, `fabricgate-<node>-<device>`, when it fits
/// 253 characters. Another node may hold it first (node `a` with device `b-x` has the name of
/// node `a-b` with device `x`): then [`alt_rule_name`] is used.
pub fn rule_name(node: &str, device: &str) -> Option<String> {
    let name = format!("{RULE_PREFIX}{node}-{device}");
    (name.len() <= MAX_NAME).then_some(name)
}

/// The name no other node can take: `fabricgate.<device>.<node>` (a device name has no dot, so
/// the node is all after the first one), the node cut to fit 253 characters and ended by `0`
/// then (a cut may end in `-` or `.`). The admission policy builds the same string in CEL
/// (deploy/base/admission-policy.yaml): keep them in step.
pub fn alt_rule_name(node: &str, device: &str) -> String {
    let room = MAX_NAME - ALT_RULE_PREFIX.len() - 1;
    let node = if node.len() + device.len() <= room {
        node.to_owned()
    } else {
        let keep = room.saturating_sub(device.len() + 1);
        format!("{}0", node.get(..keep).unwrap_or(node))
    };
    format!("{ALT_RULE_PREFIX}{device}.{node}")
}

/// The DeviceTaintRules of this node's bad HCAs: one per device of
/// [`crate::policy::Verdict::device_taints`], written by server-side apply only when it
/// differs from the rule the watch shows, and deleted when its device is no longer tainted
/// (the agent's own rules only: the watch selects [`NODE_LABEL`], and a rule whose pool is
/// another node's is left alone).
pub struct DeviceTaintRules {
    pub node: String,
    pub key: String,
    pub effect: DeviceTaintEffect,
    pub requests: kube::Client,
    pub watch: kube::Client,
    pub max_backoff: Duration,
    /// The state after each change (metrics and logs).
    pub state: watch::Sender<RulesState>,
}

impl DeviceTaintRules {
    /// The rules `taints` want, by name: each device's plain name, else (too long, held by a
    /// rule of another pool, or wanted by another driver's device of the same name) its
    /// alternative one. A device left without a free name is logged and gets no rule.
    fn desired(
        &self,
        taints: &[DeviceTaint],
        taken: &BTreeSet<String>,
    ) -> BTreeMap<String, DeviceTaint> {
        let mut want = BTreeMap::new();
        for t in taints {
            let plain = rule_name(&self.node, &t.device).filter(|n| !taken.contains(n));
            let name = plain
                .into_iter()
                .chain([alt_rule_name(&self.node, &t.device)])
                .find(|n| !want.contains_key(n));
            match name {
                Some(n) => {
                    want.insert(n, t.clone());
                }
                None => tracing::warn!(
                    driver = %t.driver,
                    device = %t.device,
                    hca = %t.hca,
                    "no free DeviceTaintRule name for this device (another driver's device of \
                     the same name holds both of its names): it gets no rule"
                ),
            }
        }
        want
    }

    fn matches(&self, rule: &DeviceTaintRule, t: &DeviceTaint) -> bool {
        let s = rule.spec.device_selector.as_ref();
        let taint = &rule.spec.taint;
        s.and_then(|s| s.driver.as_deref()) == Some(t.driver.as_str())
            && s.and_then(|s| s.pool.as_deref()) == Some(t.pool.as_str())
            && s.and_then(|s| s.device.as_deref()) == Some(t.device.as_str())
            && taint.key == self.key
            && taint.value.as_deref() == Some(t.reason.as_str())
            && taint.effect == self.effect.as_str()
            && rule
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(NODE_LABEL))
                .is_some_and(|v| *v == node_label_value(&self.node))
    }

    fn body(&self, name: &str, t: &DeviceTaint) -> serde_json::Value {
        let message: String = t.message.chars().take(1024).collect();
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {
                "name": name,
                "labels": {
                    NODE_LABEL: node_label_value(&self.node),
                    "app.kubernetes.io/managed-by": "fabricgate",
                },
                "annotations": { HCA_ANNOTATION: t.hca, MESSAGE_ANNOTATION: message },
            },
            "spec": {
                "deviceSelector": { "driver": t.driver, "pool": t.pool, "device": t.device },
                "taint": { "key": self.key, "value": t.reason, "effect": self.effect.as_str() },
            },
        })
    }

    /// Keep the rules equal to the verdicts' device taints until `stop`. Nothing is written
    /// before the first verdict; then rules of this node that no taint wants (left by an
    /// earlier run) are deleted.
    pub async fn run(
        self,
        mut verdicts: watch::Receiver<Option<Verdict>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let api: Api<DeviceTaintRule> = Api::all(self.requests.clone());
        let config = watcher::Config::default()
            .labels(&format!("{NODE_LABEL}={}", node_label_value(&self.node)))
            .timeout(WATCH_TIMEOUT_SECS)
            .any_semantic();
        let mut events = watcher(Api::<DeviceTaintRule>::all(self.watch.clone()), config)
            .backoff(WatchBackoff::new(self.max_backoff))
            .boxed();
        let mut rules = Rules::default();
        let mut wanted: Option<Vec<DeviceTaint>> = None;
        // Plain names held by a rule of another pool: this node's devices use their
        // alternative names instead.
        let mut taken = BTreeSet::new();
        let mut retry = Retry::default();
        loop {
            let dirty = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = sleep_until_opt(retry.at) => { retry.at = None; true }
                r = verdicts.changed() => {
                    if r.is_err() { return; }
                    let taints = verdicts.borrow_and_update().as_ref().map(|v| v.device_taints.clone());
                    match taints {
                        Some(t) => {
                            let changed = wanted.as_ref() != Some(&t);
                            wanted = Some(t);
                            changed
                        }
                        None => false,
                    }
                }
                event = events.next() => match event {
                    None => return,
                    Some(Ok(e)) => rules.apply(e),
                    Some(Err(e)) => match self.watch_failed(&e, &mut retry) {
                        Some(dirty) => dirty,
                        None => return,
                    },
                },
            };
            if !dirty || !rules.synced || retry.at.is_some() {
                continue;
            }
            let Some(want) = wanted.as_ref() else {
                continue;
            };
            let result = self.sync(&api, want, &rules.current, &mut taken).await;
            self.synced(result, &mut retry);
        }
    }

    /// A failed list or watch of the rules: `None` when the API does not serve them (the
    /// device path is off for good), else whether there is anything to write (never).
    fn watch_failed(&self, e: &watcher::Error, retry: &mut Retry) -> Option<bool> {
        if is_not_served(e) {
            tracing::warn!(
                "the API server does not serve resource.k8s.io/v1 \
                 DeviceTaintRules (Kubernetes older than 1.37?): bad HCAs get \
                 no device taint; the Node's own taint goes on \
                 (kubernetes.dra.taint_scope)"
            );
            self.set_state(RulesState::NotServed);
            return None;
        }
        if matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 403)
            && !retry.forbidden_logged
        {
            tracing::warn!(
                error = %e,
                "the agent may not list DeviceTaintRules: give its ClusterRole \
                 get/list/watch/create/patch/delete on \
                 resource.k8s.io devicetaintrules (daemonset.yaml has it); bad \
                 HCAs get no device taint until then"
            );
            retry.forbidden_logged = true;
            self.set_state(RulesState::Refused(
                "listing them refused: HTTP 403 (RBAC, or the admission policy)".to_owned(),
            ));
        }
        Some(false)
    }

    /// Tell the state when it changes (each change judges the node again).
    fn set_state(&self, state: RulesState) {
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }

    /// After a pass: the state, and on a failure a warning naming each failed rule (once
    /// while refused by 403) and a retry. A refusal (4xx) is [`RulesState::Refused`] at once;
    /// a server error or a lost connection after [`FAILED_PASSES`] passes in a row.
    fn synced(&self, failed: Vec<(String, kube::Error)>, retry: &mut Retry) {
        if failed.is_empty() {
            retry.backoff = FIRST_BACKOFF;
            retry.forbidden_logged = false;
            retry.failed_passes = 0;
            self.set_state(RulesState::On);
            return;
        }
        retry.failed_passes += 1;
        let code = |e: &kube::Error| match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        };
        let forbidden = failed.iter().all(|(_, e)| code(e) == Some(403));
        let refused = failed
            .iter()
            .any(|(_, e)| code(e).is_some_and(|c| (400..500).contains(&c)));
        let errors = failed
            .iter()
            .map(|(rule, e)| match e {
                kube::Error::Api(s) => format!("{rule}: HTTP {} {}", s.code, s.message),
                e => format!("{rule}: {e}"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        if refused || retry.failed_passes >= FAILED_PASSES {
            self.set_state(RulesState::Refused(errors.clone()));
        }
        if !retry.forbidden_logged || !forbidden {
            tracing::warn!(
                errors = %errors,
                retry_in = ?retry.backoff,
                "cannot write this node's DeviceTaintRules{}",
                if forbidden {
                    " (RBAC, or the admission policy \
                     fabricgate-device-taint-rules refused it)"
                } else {
                    ""
                }
            );
            retry.forbidden_logged |= forbidden;
        }
        retry.at = Some(Instant::now() + retry.backoff);
        retry.backoff = (retry.backoff * 2).min(self.max_backoff.max(FIRST_BACKOFF));
    }

    /// One pass: apply the rules that differ, delete ours that are not wanted. A plain name
    /// found held by another pool's rule joins `taken` and the pass goes on with the
    /// alternative name. A refused or failed rule never stops the others: every failure is
    /// returned, by rule name.
    async fn sync(
        &self,
        api: &Api<DeviceTaintRule>,
        taints: &[DeviceTaint],
        rules: &BTreeMap<String, DeviceTaintRule>,
        taken: &mut BTreeSet<String>,
    ) -> Vec<(String, kube::Error)> {
        let mut done = BTreeSet::new();
        let mut failed = Vec::new();
        let want = loop {
            let want = self.desired(taints, taken);
            let mut renamed = false;
            for (name, t) in &want {
                if done.contains(name) {
                    continue;
                }
                match self.write(api, name, t, rules.get(name)).await {
                    Ok(Written::Done) => {
                        done.insert(name.clone());
                    }
                    Ok(Written::Taken(pool)) => {
                        tracing::warn!(
                            rule = %name,
                            held_by_pool = pool.as_deref().unwrap_or("(one this agent may not change)"),
                            "a DeviceTaintRule of another pool holds this device's name: \
                             its rule is named {} instead",
                            alt_rule_name(&self.node, &t.device)
                        );
                        taken.insert(name.clone());
                        renamed = true;
                    }
                    Err(e) => {
                        done.insert(name.clone());
                        failed.push((name.clone(), e));
                    }
                }
            }
            if !renamed {
                break want;
            }
        };
        let ours: BTreeSet<&String> = rules
            .iter()
            .filter(|(_, r)| pool_of(r) == Some(self.node.as_str()))
            .map(|(n, _)| n)
            .collect();
        for name in ours {
            if want.contains_key(name) {
                continue;
            }
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {
                    tracing::info!(rule = %name, "DeviceTaintRule removed: the device is healthy")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => failed.push((name.clone(), e)),
            }
        }
        failed
    }

    /// Make the rule `name` say `t`, unless it already does; `existing`: the rule as the watch
    /// shows it.
    async fn write(
        &self,
        api: &Api<DeviceTaintRule>,
        name: &str,
        t: &DeviceTaint,
        existing: Option<&DeviceTaintRule>,
    ) -> kube::Result<Written> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match existing {
            Some(r) if pool_of(r) != Some(self.node.as_str()) => {
                return Ok(Written::Taken(pool_of(r).map(str::to_owned)));
            }
            Some(r) if self.matches(r, t) => return Ok(Written::Done),
            // A new rule is created (an apply that creates needs the create verb too); one
            // that differs (edited by hand, a new reason) is applied.
            None => {
                let create = PostParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..PostParams::default()
                };
                let rule: DeviceTaintRule =
                    serde_json::from_value(self.body(name, t)).map_err(kube::Error::SerdeError)?;
                match api.create(&create, &rule).await {
                    Ok(_) => {}
                    // Not in the watch (yet): ours, or another pool's that this agent may not
                    // change (the admission policy refuses the apply).
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        match api
                            .patch(name, &params, &Patch::Apply(self.body(name, t)))
                            .await
                        {
                            Ok(_) => {}
                            Err(kube::Error::Api(s)) if s.code == 403 => {
                                return Ok(Written::Taken(None));
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            Some(_) => {
                api.patch(name, &params, &Patch::Apply(self.body(name, t)))
                    .await?;
            }
        }
        tracing::warn!(
            rule = %name,
            hca = %t.hca,
            driver = %t.driver,
            device = %t.device,
            reason = %t.reason,
            effect = self.effect.as_str(),
            "DeviceTaintRule set: {}",
            t.message
        );
        Ok(Written::Done)
    }
}

/// How one rule's write ended.
enum Written {
    Done,
    /// The name is held by a rule of another pool (named when the watch shows it).
    Taken(Option<String>),
}

fn pool_of(rule: &DeviceTaintRule) -> Option<&str> {
    rule.spec
        .device_selector
        .as_ref()
        .and_then(|s| s.pool.as_deref())
}

/// The writer's own rules as its watch shows them, by name; a relist replaces them once done.
#[derive(Default)]
struct Rules {
    current: BTreeMap<String, DeviceTaintRule>,
    listing: BTreeMap<String, DeviceTaintRule>,
    synced: bool,
}

impl Rules {
    /// Whether the rules may now differ from the wanted ones.
    fn apply(&mut self, event: Event<DeviceTaintRule>) -> bool {
        let name = |r: &DeviceTaintRule| r.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Init => {
                self.listing.clear();
                false
            }
            Event::InitApply(r) => {
                self.listing.insert(name(&r), r);
                false
            }
            Event::InitDone => {
                self.current = std::mem::take(&mut self.listing);
                self.synced = true;
                true
            }
            Event::Apply(r) => {
                self.current.insert(name(&r), r);
                true
            }
            Event::Delete(r) => {
                self.current.remove(&name(&r));
                true
            }
        }
    }
}

/// Passes in a row failed by server errors or lost connections before the rules count as
/// refused.
const FAILED_PASSES: u32 = 3;

/// When the writer tries again after a refused or failed write.
struct Retry {
    at: Option<Instant>,
    backoff: Duration,
    /// A 403 was logged: the next ones are not, until a write succeeds.
    forbidden_logged: bool,
    /// Passes in a row with a failure.
    failed_passes: u32,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            at: None,
            backoff: FIRST_BACKOFF,
            forbidden_logged: false,
            failed_passes: 0,
        }
    }
}

/// Mirror the DeviceTaintRule writer's state into `fabricgate_dra_device_rules_writable`.
pub async fn follow_state(
    metrics: Arc<Metrics>,
    families: DraMetrics,
    mut state: watch::Receiver<RulesState>,
) {
    loop {
        let writable = *state.borrow_and_update() == RulesState::On;
        families.set_rules_writable(&metrics, writable);
        if state.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(device: &str) -> DeviceTaint {
        DeviceTaint {
            driver: "dra.net".into(),
            pool: "n".into(),
            device: device.into(),
            hca: "mlx5_3".into(),
            reason: "PortDown".into(),
            message: "port down".into(),
        }
    }

    #[test]
    fn rule_names_and_labels_stay_within_the_apis_limits() {
        assert_eq!(
            rule_name("gpu-1", "pci-0000-1b-00-0").as_deref(),
            Some("fabricgate-gpu-1-pci-0000-1b-00-0")
        );
        let long = "n".repeat(250);
        assert_eq!(rule_name(&long, "pci-0000-1b-00-0"), None);
        let name = alt_rule_name(&long, "pci-0000-1b-00-0");
        assert_eq!(name.len(), 253, "{name}");
        assert!(name.starts_with("fabricgate.pci-0000-1b-00-0.nnn") && name.ends_with("n0"));
        assert_ne!(name, alt_rule_name(&long, "pci-0000-1c-00-0"));
        assert_eq!(node_label_value("gpu-1"), "gpu-1");
        let v = node_label_value(&"a".repeat(64));
        assert!(v.len() <= 63 && v.starts_with("fnv-"), "{v}");
    }

    #[test]
    fn the_alternative_name_tells_nodes_apart_where_the_plain_one_cannot() {
        // Node `dra` with device `a-pci-0` has node `dra-a`'s plain name for `pci-0`.
        assert_eq!(rule_name("dra", "a-pci-0"), rule_name("dra-a", "pci-0"));
        assert_eq!(alt_rule_name("dra-a", "pci-0"), "fabricgate.pci-0.dra-a");
        assert_ne!(
            alt_rule_name("dra", "a-pci-0"),
            alt_rule_name("dra-a", "pci-0")
        );
        // Fits exactly: not cut.
        let node = "m".repeat(253 - "fabricgate.".len() - 1 - 5);
        assert_eq!(
            alt_rule_name(&node, "pci-0"),
            format!("fabricgate.pci-0.{node}")
        );
    }

    fn writer(node: &str) -> DeviceTaintRules {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                .unwrap();
        DeviceTaintRules {
            node: node.into(),
            key: "fabricgate.io/unvalidated".into(),
            effect: DeviceTaintEffect::NoSchedule,
            requests: client.clone(),
            watch: client,
            max_backoff: Duration::from_secs(1),
            state: watch::channel(RulesState::On).0,
        }
    }

    #[tokio::test]
    async fn a_taken_name_or_a_second_driver_of_the_same_device_gets_the_alternative_name() {
        let w = writer("n");
        let mut other = taint("pci-0000-1b-00-0");
        other.driver = "other.example.com".into();
        let taints = [taint("pci-0000-1b-00-0"), other];
        let want = w.desired(&taints, &BTreeSet::new());
        let names: Vec<&str> = want.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "fabricgate-n-pci-0000-1b-00-0",
                "fabricgate.pci-0000-1b-00-0.n"
            ]
        );
        assert_eq!(want["fabricgate-n-pci-0000-1b-00-0"].driver, "dra.net");
        let taken = BTreeSet::from(["fabricgate-n-pci-0000-1b-00-0".to_owned()]);
        let want = w.desired(&taints[..1], &taken);
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            ["fabricgate.pci-0000-1b-00-0.n"]
        );
    }
}
