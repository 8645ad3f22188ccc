//! Everything fabricgate does to Kubernetes, against a real control plane: Kubernetes' own
//! etcd, kube-apiserver and kube-scheduler (`tests/common/controlplane.rs`), shared by all
//! tests of this binary, each with its own Node names. Faults come from a proxy in front of
//! the real apiserver (`tests/common/faultproxy.rs`). Request counts come from the
//! apiserver's audit log, never from the agent's own counters.
//!
//! Without the control plane binary (`.ci/controlplane.sh` builds it) each test prints
//! `SKIP:` and passes, except under `CI=true`, where that is a failure.

mod common;

// Each module's tests share the control plane of this process; the Agent and Node harness
// (`TestNode`, `start_agent`, ...) is in `common`.
#[path = "cluster/admission_check.rs"]
mod admission_check;
#[path = "cluster/agent.rs"]
mod agent;
#[path = "cluster/agenterror.rs"]
mod agenterror;
#[path = "cluster/breaker.rs"]
mod breaker;
#[path = "cluster/cleanup.rs"]
mod cleanup;
#[path = "cluster/deviceplugin.rs"]
mod deviceplugin;
#[path = "cluster/dra.rs"]
mod dra;
#[path = "cluster/fleet.rs"]
mod fleet;
#[path = "cluster/gang.rs"]
mod gang;
#[path = "cluster/gang_ring.rs"]
mod gang_ring;
#[path = "cluster/guard.rs"]
mod guard;
#[path = "cluster/helm.rs"]
mod helm;
#[path = "cluster/kueue.rs"]
mod kueue;
#[path = "cluster/kueue_requeue.rs"]
mod kueue_requeue;
#[path = "cluster/overlays.rs"]
mod overlays;
#[path = "cluster/placement.rs"]
mod placement;
#[path = "cluster/runtime_transport.rs"]
mod runtime_transport;
#[path = "cluster/scheduler.rs"]
mod scheduler;
#[path = "cluster/security.rs"]
mod security;
#[path = "cluster/vap.rs"]
mod vap;
#[path = "cluster/webhook.rs"]
mod webhook;
