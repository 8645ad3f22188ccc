//! This node's ResourceSlices in: watched (field selector `spec.nodeName`), read into the
//! configured drivers' devices ([`published`]) and sent as [`DraFacts`] after each change.

use super::assess::{DraFacts, published};
use super::common::{is_not_served, sleep_until_opt};
use super::settings::DraDriver;
use crate::node::WATCH_TIMEOUT_SECS;
use crate::node::WatchBackoff;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

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
    let mut slices = Slices::default();
    let mut hold = Hold::new(grace);
    let mut warned_missing = false;
    loop {
        let event = tokio::select! {
            () = tx.closed() => return,
            () = sleep_until_opt(hold.next_deadline()) => None,
            event = events.next() => match event {
                Some(e) => Some(e),
                None => return,
            },
        };
        match event {
            Some(Ok(e)) => slices.apply(e),
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
        if !slices.synced {
            continue;
        }
        let list: Vec<ResourceSlice> = slices.current.values().cloned().collect();
        if let Some(facts) = hold.apply(published(&list, &drivers), Instant::now()) {
            tx.send_replace(Some(facts));
        }
    }
}

/// The slices as the watch shows them, by name; a relist replaces them once it is done.
#[derive(Default)]
struct Slices {
    current: BTreeMap<String, ResourceSlice>,
    listing: BTreeMap<String, ResourceSlice>,
    synced: bool,
}

impl Slices {
    fn apply(&mut self, event: Event<ResourceSlice>) {
        match event {
            Event::Init => self.listing.clear(),
            Event::InitApply(s) => {
                self.listing.insert(key(&s), s);
            }
            Event::InitDone => {
                self.current = std::mem::take(&mut self.listing);
                self.synced = true;
            }
            Event::Apply(s) => {
                self.current.insert(key(&s), s);
            }
            Event::Delete(s) => {
                self.current.remove(&key(&s));
            }
        }
    }
}

fn key(s: &ResourceSlice) -> String {
    s.metadata.name.clone().unwrap_or_default()
}

/// `kubernetes.dra.slice_grace`: a driver whose slices vanish after it had some keeps its last
/// devices until a deadline.
struct Hold {
    grace: Duration,
    /// The last facts published.
    shown: Option<DraFacts>,
    /// Drivers held (their last devices kept) until a deadline.
    held: BTreeMap<String, Instant>,
    /// Drivers whose hold ran out while they are still without slices.
    expired: BTreeSet<String>,
}

impl Hold {
    fn new(grace: Duration) -> Self {
        Self {
            grace,
            shown: None,
            held: BTreeMap::new(),
            expired: BTreeSet::new(),
        }
    }

    /// When the next hold ends.
    fn next_deadline(&self) -> Option<Instant> {
        self.held.values().min().copied()
    }

    /// The facts to publish for the slices read at `now` (`facts`, holds applied); `None`
    /// when they are the ones published last.
    fn apply(&mut self, mut facts: DraFacts, now: Instant) -> Option<DraFacts> {
        let grace = self.grace;
        let expired = &mut self.expired;
        self.held.retain(|driver, until| {
            let absent = facts.drivers_without_slices.contains(driver);
            if absent && *until <= now {
                expired.insert(driver.clone());
            }
            *until > now && absent
        });
        expired.retain(|d| facts.drivers_without_slices.contains(d));
        if let Some(before) = &self.shown {
            for driver in facts.drivers_without_slices.clone() {
                let had = before.devices.iter().any(|d| d.driver == driver);
                if had
                    && !grace.is_zero()
                    && !self.held.contains_key(&driver)
                    && !expired.contains(&driver)
                {
                    tracing::info!(
                        driver = %driver,
                        grace = %humantime::format_duration(grace),
                        "the DRA driver's ResourceSlices of this node are gone (as when the \
                         kubelet restarts): waiting up to kubernetes.dra.slice_grace for them"
                    );
                    self.held.insert(driver, now + grace);
                }
            }
            for driver in self.held.keys() {
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
        if self.shown.as_ref() == Some(&facts) {
            return None;
        }
        self.shown = Some(facts.clone());
        Some(facts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::assess::PublishedDevice;

    #[test]
    fn a_driver_whose_slices_vanish_is_held_for_the_grace_then_reported_once() {
        let device = PublishedDevice {
            driver: "dra.net".into(),
            pool: "n".into(),
            device: "pci-0000-1b-00-0".into(),
            rdma_device: Some("mlx5_0".into()),
            pci_address: None,
        };
        let with = DraFacts {
            devices: vec![device],
            ..DraFacts::default()
        };
        let without = DraFacts {
            devices: Vec::new(),
            drivers_without_slices: vec!["dra.net".into()],
            ..DraFacts::default()
        };
        let grace = Duration::from_secs(45);
        let mut hold = Hold::new(grace);
        let t0 = Instant::now();
        assert_eq!(hold.apply(with.clone(), t0), Some(with.clone()));
        assert_eq!(
            hold.apply(with.clone(), t0),
            None,
            "unchanged: nothing sent"
        );
        // Gone (a kubelet restart?): its last devices are kept until the grace ends.
        assert_eq!(hold.apply(without.clone(), t0), None);
        assert_eq!(hold.next_deadline(), Some(t0 + grace));
        // Still gone when it ends: reported without slices, once, and not held again.
        assert_eq!(
            hold.apply(without.clone(), t0 + grace),
            Some(without.clone())
        );
        assert_eq!(hold.next_deadline(), None);
        assert_eq!(hold.apply(without.clone(), t0 + grace * 2), None);
        // Back, then gone again: a new hold.
        assert_eq!(hold.apply(with.clone(), t0 + grace * 3), Some(with.clone()));
        assert_eq!(hold.apply(without, t0 + grace * 3), None);
        assert_eq!(hold.next_deadline(), Some(t0 + grace * 4));
    }

    #[test]
    fn without_a_grace_a_driver_is_reported_gone_at_once() {
        let with = DraFacts {
            devices: vec![PublishedDevice {
                driver: "dra.net".into(),
                pool: "n".into(),
                device: "d".into(),
                rdma_device: None,
                pci_address: None,
            }],
            ..DraFacts::default()
        };
        let without = DraFacts {
            devices: Vec::new(),
            drivers_without_slices: vec!["dra.net".into()],
            ..DraFacts::default()
        };
        let mut hold = Hold::new(Duration::ZERO);
        let t0 = Instant::now();
        assert_eq!(hold.apply(with.clone(), t0), Some(with));
        assert_eq!(hold.apply(without.clone(), t0), Some(without));
    }
}
