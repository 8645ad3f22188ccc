//! Leader election on a `coordination.k8s.io` Lease (the guard's and the admission check's).

use crate::error::{Error, Result};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use std::time::{Duration, Instant};

/// Acquire or renew the Lease; `true` while this replica holds it. Optimistic concurrency
/// (`resourceVersion`) decides between replicas racing for an expired Lease.
/// Who competes for which Lease.
pub struct Election<'a> {
    pub lease_name: &'a str,
    pub identity: &'a str,
    pub lease_duration: Duration,
}

fn kube_err(action: &'static str, lease: &str, source: kube::Error) -> Error {
    Error::KubeObject {
        action,
        object: format!("Lease {lease}"),
        source: Box::new(source),
    }
}

/// Annotations the holder keeps on its Lease, written with each renewal: `(key, value)`,
/// the value `None` to remove it; a key not named is left as it is.
pub type Publish<'a> = &'a [(&'a str, Option<&'a str>)];

/// Set or remove the published annotations on `meta`.
fn publish_on(meta: &mut ObjectMeta, publish: Publish<'_>) {
    for &(key, value) in publish {
        publish_one(meta, key, value);
    }
}

fn publish_one(meta: &mut ObjectMeta, key: &str, value: Option<&str>) {
    match value {
        Some(v) => {
            meta.annotations
                .get_or_insert_with(Default::default)
                .insert(key.to_owned(), v.to_owned());
        }
        None => {
            if let Some(a) = meta.annotations.as_mut() {
                a.remove(key);
            }
        }
    }
}

pub async fn try_lead(leases: &Api<Lease>, s: &Election<'_>, publish: Publish<'_>) -> Result<bool> {
    let now = Timestamp::now();
    let secs = i32::try_from(s.lease_duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let current = leases
        .get_opt(s.lease_name)
        .await
        .map_err(|e| kube_err("read", s.lease_name, e))?;
    let Some(mut lease) = current else {
        let mut metadata = ObjectMeta {
            name: Some(s.lease_name.to_owned()),
            ..ObjectMeta::default()
        };
        publish_on(&mut metadata, publish);
        let lease = Lease {
            metadata,
            spec: Some(LeaseSpec {
                holder_identity: Some(s.identity.to_owned()),
                lease_duration_seconds: Some(secs),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(kube_err("create", s.lease_name, e)),
        };
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let mine = spec.holder_identity.as_deref() == Some(s.identity);
    let duration = Duration::from_secs(
        u64::try_from(spec.lease_duration_seconds.unwrap_or(secs)).unwrap_or(0),
    );
    let expired = spec.renew_time.as_ref().is_none_or(|t| {
        now.duration_since(t.0)
            .try_into()
            .is_ok_and(|age: Duration| age > duration)
    }) || spec.holder_identity.as_deref().is_none_or(str::is_empty);
    if !mine && !expired {
        return Ok(false);
    }
    let mut new_spec = spec.clone();
    new_spec.holder_identity = Some(s.identity.to_owned());
    new_spec.lease_duration_seconds = Some(secs);
    new_spec.renew_time = Some(MicroTime(now));
    if !mine {
        new_spec.acquire_time = Some(MicroTime(now));
        new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    lease.spec = Some(new_spec);
    publish_on(&mut lease.metadata, publish);
    match leases
        .replace(s.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => {
            if !mine {
                tracing::info!(identity = %s.identity, "acquired the lease");
            }
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(kube_err("renew", s.lease_name, e)),
    }
}

/// Give the Lease up (on shutdown): the other replica takes it at once.
pub async fn release(leases: &Api<Lease>, s: &Election<'_>) -> Result<()> {
    let patch = json!({ "spec": { "holderIdentity": null, "renewTime": null } });
    leases
        .patch(s.lease_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| kube_err("release", s.lease_name, e))?;
    Ok(())
}

/// One replica's leadership between renewals (the guard's and the admission check's loops).
#[derive(Debug, Default)]
pub struct Leadership {
    leading: bool,
    last_renewed: Option<Instant>,
}

/// What one renewal found.
#[derive(Debug, Clone, Copy)]
pub struct Renewal {
    /// This replica holds the Lease now.
    pub leading: bool,
    /// It did not before this renewal, or no longer does.
    pub changed: bool,
    /// Keep the leader's watches: while leading, and through a failed renewal as long as its
    /// Lease cannot have passed to another replica yet (a short API outage costs no new list).
    pub keep_watches: bool,
}

impl Leadership {
    /// Acquire or renew the Lease; an API error counts as not leading (logged).
    pub async fn renew(&mut self, leases: &Api<Lease>, e: &Election<'_>) -> Renewal {
        self.renew_publishing(leases, e, &[]).await
    }

    /// [`Leadership::renew`], keeping `publish` on the Lease when this replica writes it.
    pub async fn renew_publishing(
        &mut self,
        leases: &Api<Lease>,
        e: &Election<'_>,
        publish: Publish<'_>,
    ) -> Renewal {
        let lead = match try_lead(leases, e, publish).await {
            Ok(l) => {
                self.last_renewed = l.then(Instant::now);
                l
            }
            Err(err) => {
                tracing::warn!(error = %err, "lease: cannot read or renew; not acting");
                false
            }
        };
        let changed = lead != self.leading;
        if changed {
            tracing::info!(identity = %e.identity, leader = lead, "leadership changed");
            self.leading = lead;
        }
        let keep_watches = self.leading
            || self
                .last_renewed
                .is_some_and(|t| t.elapsed() < e.lease_duration);
        Renewal {
            leading: self.leading,
            changed,
            keep_watches,
        }
    }
}
