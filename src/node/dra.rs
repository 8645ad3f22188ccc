//! DRA on the API side (docs/dra.md): the watch of this node's ResourceSlices
//! ([`watch_slices`]) and the `DeviceTaintRule`s of its bad HCAs ([`DeviceTaintRules`]).

use super::FIELD_MANAGER;
use super::client::WATCH_TIMEOUT_SECS;
use super::watch::WatchBackoff;
use crate::config::dra::{DeviceTaintEffect, DraDriver};
use crate::policy::dra::{DeviceTaint, DraFacts, published};
use futures::StreamExt;
use k8s_openapi::api::resource::v1::{DeviceTaintRule, ResourceSlice};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
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
/// Every rule's name starts with this (the admission policy checks it).
pub const RULE_PREFIX: &str = "fabricgate-";

/// [`NODE_LABEL`]'s value for `node`.
pub fn node_label_value(node: &str) -> String {
    if !node.is_empty() && node.len() <= 63 {
        node.to_owned()
    } else {
        format!("fnv-{:016x}", super::fabriccheck::fnv64(node))
    }
}

/// The rule's name for a device of `node`: `fabricgate-<node>-<device>`, the node hashed when
/// that would pass 253 characters.
pub fn rule_name(node: &str, taint: &DeviceTaint) -> String {
    let name = format!("{RULE_PREFIX}{node}-{}", taint.device);
    if name.len() <= 253 {
        return name;
    }
    let key = format!("{}/{}", taint.driver, taint.device);
    format!(
        "{RULE_PREFIX}fnv-{:016x}-{:016x}",
        super::fabriccheck::fnv64(node),
        super::fabriccheck::fnv64(&key)
    )
}

/// Watch this node's ResourceSlices (field selector `spec.nodeName`) and send the configured
/// drivers' devices after each change, once the watch has listed. A driver whose slices all
/// vanish is reported without slices only after `grace` (the kubelet deletes every slice of
/// its node when it starts and the plugins publish them again; a plugin that is really gone
/// is caught at once by its registration socket). Ends when `tx` is closed; an API that does
/// not serve ResourceSlices (older than 1.34) ends it with one warning.
pub async fn watch_slices(
    client: kube::Client,
    node: String,
    drivers: Vec<DraDriver>,
    grace: Duration,
    tx: watch::Sender<Option<DraFacts>>,
    max_backoff: Duration,
) {
    let api: Api<ResourceSlice> = Api::all(client);
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic();
    let mut events = watcher(api, config)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    let mut slices: BTreeMap<String, ResourceSlice> = BTreeMap::new();
    let mut listing: BTreeMap<String, ResourceSlice> = BTreeMap::new();
    let mut synced = false;
    // The last facts published, and drivers held (their last devices kept) until a deadline.
    let mut shown: Option<DraFacts> = None;
    let mut held: BTreeMap<String, Instant> = BTreeMap::new();
    // Drivers whose hold ran out while they are still without slices.
    let mut expired: BTreeSet<String> = BTreeSet::new();
    let mut warned_missing = false;
    loop {
        let next_hold = held.values().min().copied();
        let event = tokio::select! {
            () = tx.closed() => return,
            () = sleep_until_opt(next_hold) => None,
            event = events.next() => match event {
                Some(e) => Some(e),
                None => return,
            },
        };
        match event {
            Some(Ok(Event::Init)) => listing.clear(),
            Some(Ok(Event::InitApply(s))) => {
                listing.insert(key(&s), s);
            }
            Some(Ok(Event::InitDone)) => {
                slices = std::mem::take(&mut listing);
                synced = true;
            }
            Some(Ok(Event::Apply(s))) => {
                slices.insert(key(&s), s);
            }
            Some(Ok(Event::Delete(s))) => {
                slices.remove(&key(&s));
            }
            Some(Err(e)) => {
                if is_not_served(&e) {
                    if !warned_missing {
                        tracing::warn!(
                            "the API server does not serve resource.k8s.io/v1 ResourceSlices \
                             (Kubernetes older than 1.34?): kubernetes.dra cannot be checked; \
                             the node's own checks go on"
                        );
                        warned_missing = true;
                    }
                } else {
                    tracing::debug!(node = %node, error = %e, "watch of the ResourceSlices broke");
                }
                continue;
            }
            None => {} // a hold ended
        }
        if !synced {
            continue;
        }
        let list: Vec<ResourceSlice> = slices.values().cloned().collect();
        let mut facts = published(&list, &drivers);
        let now = Instant::now();
        held.retain(|driver, until| {
            let absent = facts.drivers_without_slices.contains(driver);
            if absent && *until <= now {
                expired.insert(driver.clone());
            }
            *until > now && absent
        });
        expired.retain(|d| facts.drivers_without_slices.contains(d));
        if let Some(before) = &shown {
            for driver in facts.drivers_without_slices.clone() {
                let had = before.devices.iter().any(|d| d.driver == driver);
                if had
                    && !grace.is_zero()
                    && !held.contains_key(&driver)
                    && !expired.contains(&driver)
                {
                    tracing::info!(
                        driver = %driver,
                        grace = %humantime::format_duration(grace),
                        "the DRA driver's ResourceSlices of this node are gone (as when the \
                         kubelet restarts): waiting up to kubernetes.dra.slice_grace for them"
                    );
                    held.insert(driver, now + grace);
                }
            }
            for driver in held.keys() {
                facts.drivers_without_slices.retain(|d| d != driver);
                facts.devices.extend(
                    before
                        .devices
                        .iter()
                        .filter(|d| d.driver == *driver)
                        .cloned(),
                );
            }
            facts.devices.sort();
        }
        if shown.as_ref() != Some(&facts) {
            shown = Some(facts.clone());
            tx.send_replace(Some(facts));
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn key(s: &ResourceSlice) -> String {
    s.metadata.name.clone().unwrap_or_default()
}

/// A list or watch of a resource the API server does not serve: 404 (or the discovery
/// errors kube reports for it).
fn is_not_served(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => is_404(e),
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

fn is_404(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// What the rule writer's watch and writes found out about the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulesState {
    /// Rules are written.
    On,
    /// The API server does not serve `DeviceTaintRule` (older than 1.37): the device path is
    /// off; the Node path goes on.
    NotServed,
    /// The API server refuses the agent (RBAC or the admission policy): retried slowly.
    Forbidden,
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
    fn desired(&self, taints: &[DeviceTaint]) -> BTreeMap<String, DeviceTaint> {
        taints
            .iter()
            .map(|t| (rule_name(&self.node, t), t.clone()))
            .collect()
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
        mut verdicts: watch::Receiver<Option<crate::policy::Verdict>>,
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
        let mut rules: BTreeMap<String, DeviceTaintRule> = BTreeMap::new();
        let mut listing: BTreeMap<String, DeviceTaintRule> = BTreeMap::new();
        let mut synced = false;
        let mut wanted: Option<BTreeMap<String, DeviceTaint>> = None;
        let mut retry_at: Option<Instant> = None;
        let mut backoff = super::watch::FIRST_BACKOFF;
        let mut forbidden_logged = false;
        loop {
            let dirty = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = sleep_until_opt(retry_at) => { retry_at = None; true }
                r = verdicts.changed() => {
                    if r.is_err() { return; }
                    let taints = verdicts.borrow_and_update().as_ref().map(|v| v.device_taints.clone());
                    match taints {
                        Some(t) => {
                            let d = self.desired(&t);
                            let changed = wanted.as_ref() != Some(&d);
                            wanted = Some(d);
                            changed
                        }
                        None => false,
                    }
                }
                event = events.next() => match event {
                    None => return,
                    Some(Ok(Event::Init)) => { listing.clear(); false }
                    Some(Ok(Event::InitApply(r))) => {
                        listing.insert(r.metadata.name.clone().unwrap_or_default(), r);
                        false
                    }
                    Some(Ok(Event::InitDone)) => {
                        rules = std::mem::take(&mut listing);
                        synced = true;
                        true
                    }
                    Some(Ok(Event::Apply(r))) => {
                        rules.insert(r.metadata.name.clone().unwrap_or_default(), r);
                        true
                    }
                    Some(Ok(Event::Delete(r))) => {
                        rules.remove(&r.metadata.name.clone().unwrap_or_default());
                        true
                    }
                    Some(Err(e)) => {
                        if is_not_served(&e) {
                            tracing::warn!(
                                "the API server does not serve resource.k8s.io/v1 \
                                 DeviceTaintRules (Kubernetes older than 1.37?): bad HCAs get \
                                 no device taint; the Node's own taint goes on \
                                 (kubernetes.dra.taint_scope)"
                            );
                            self.state.send_replace(RulesState::NotServed);
                            return;
                        }
                        if matches!(&e, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 403)
                            && !forbidden_logged
                        {
                            tracing::warn!(
                                error = %e,
                                "the agent may not list DeviceTaintRules: give its ClusterRole \
                                 get/list/watch/create/patch/delete on \
                                 resource.k8s.io devicetaintrules (daemonset.yaml has it); bad \
                                 HCAs get no device taint until then"
                            );
                            forbidden_logged = true;
                            self.state.send_replace(RulesState::Forbidden);
                        }
                        false
                    }
                },
            };
            if !dirty || !synced || retry_at.is_some() {
                continue;
            }
            let Some(want) = wanted.as_ref() else {
                continue;
            };
            match self.sync(&api, want, &rules).await {
                Ok(()) => {
                    backoff = super::watch::FIRST_BACKOFF;
                    forbidden_logged = false;
                    self.state.send_replace(RulesState::On);
                }
                Err(e) => {
                    let forbidden = matches!(&e, kube::Error::Api(s) if s.code == 403);
                    if forbidden {
                        self.state.send_replace(RulesState::Forbidden);
                    }
                    if !forbidden_logged || !forbidden {
                        tracing::warn!(
                            error = %e,
                            retry_in = ?backoff,
                            "cannot write this node's DeviceTaintRules{}",
                            if forbidden {
                                " (RBAC, or the admission policy \
                                 fabricgate-device-taint-rules refused it)"
                            } else {
                                ""
                            }
                        );
                        forbidden_logged |= forbidden;
                    }
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(self.max_backoff.max(super::watch::FIRST_BACKOFF));
                }
            }
        }
    }

    /// One pass: apply the rules that differ, delete ours that are not wanted.
    async fn sync(
        &self,
        api: &Api<DeviceTaintRule>,
        want: &BTreeMap<String, DeviceTaint>,
        rules: &BTreeMap<String, DeviceTaintRule>,
    ) -> kube::Result<()> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let create = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        for (name, t) in want {
            match rules.get(name) {
                Some(r) if self.matches(r, t) => continue,
                // A new rule is created (an apply that creates needs the create verb too); one
                // that differs (edited by hand, a new reason) is applied.
                None => {
                    let rule: DeviceTaintRule = serde_json::from_value(self.body(name, t))
                        .map_err(kube::Error::SerdeError)?;
                    match api.create(&create, &rule).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 409 => {
                            api.patch(name, &params, &Patch::Apply(self.body(name, t)))
                                .await?;
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
        }
        let ours: BTreeSet<&String> = rules
            .iter()
            .filter(|(_, r)| {
                r.spec
                    .device_selector
                    .as_ref()
                    .and_then(|s| s.pool.as_deref())
                    == Some(self.node.as_str())
            })
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
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
            rule_name("gpu-1", &taint("pci-0000-1b-00-0")),
            "fabricgate-gpu-1-pci-0000-1b-00-0"
        );
        let long = "n".repeat(250);
        let name = rule_name(&long, &taint("pci-0000-1b-00-0"));
        assert!(name.len() <= 253 && name.starts_with(RULE_PREFIX), "{name}");
        assert_ne!(name, rule_name(&long, &taint("pci-0000-1c-00-0")));
        assert_eq!(node_label_value("gpu-1"), "gpu-1");
        let v = node_label_value(&"a".repeat(64));
        assert!(v.len() <= 63 && v.starts_with("fnv-"), "{v}");
    }
}
