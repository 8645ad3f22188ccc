//! The probe thread: the prober lives on its own thread for the agent's life, so a hung statfs
//! or verbs call never blocks the async runtime (which is single-threaded).

use super::timing::Failpoint;
use crate::error::{Error, Result};
use fabricgate_probes::rdma::sysfs::PortStateRead;
use fabricgate_probes::{ProbeReport, Prober};
use tokio::sync::oneshot;

/// The host checks `run` makes beside each probe: the device plugins' sockets and device nodes
/// (`kubernetes.*`), the DRA drivers' registration sockets (`kubernetes.dra`), and the agent's
/// own mounts.
pub(super) fn host_checks(
    k: &crate::config::KubernetesRequirements,
    dra: &crate::dra::settings::DraSettings,
) -> fabricgate_probes::host::HostConfig {
    fabricgate_probes::host::HostConfig {
        device_plugin_dir: std::path::PathBuf::from(&k.device_plugin_dir),
        device_plugin_sockets: k.device_plugin_sockets.clone(),
        device_nodes: !k.rdma_resources.is_empty(),
        own_mounts: true,
        dra_registry_dir: std::path::PathBuf::from(&dra.registry_dir),
        dra_drivers: dra.driver_names(),
    }
}

/// The prober lives on its own thread for the agent's life: a probe may block (hung mounts,
/// verbs), and its storage workers must persist across ticks. A thread stuck in a probe does not
/// delay shutdown: nobody joins it.
pub(super) struct ProbeThread {
    requests: std::sync::mpsc::Sender<ProbeRequest>,
}

/// What the probe thread is asked for.
pub(super) enum ProbeRequest {
    /// A full probe.
    Full(oneshot::Sender<ProbeReport>),
    /// Only the ports' states (the fail-fast read of an event-triggered probe).
    PortStates(oneshot::Sender<Vec<PortStateRead>>),
}

impl ProbeThread {
    pub(super) fn spawn(mut prober: Prober, failpoint: Failpoint) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<ProbeRequest>();
        std::thread::Builder::new()
            .name("fabricgate-probe".into())
            .spawn(move || {
                let mut done: u64 = 0;
                while let Ok(request) = rx.recv() {
                    let reply = match request {
                        ProbeRequest::Full(reply) => reply,
                        ProbeRequest::PortStates(reply) => {
                            let _ = reply.send(prober.port_states());
                            continue;
                        }
                    };
                    match failpoint {
                        Failpoint::ProbeStall if done >= 1 => loop {
                            std::thread::park();
                        },
                        Failpoint::ProbePanic if done >= 1 => {
                            panic!("failpoint probe-panic: the probe thread panics")
                        }
                        _ => {}
                    }
                    let report = prober.probe();
                    done += 1;
                    let _ = reply.send(report);
                }
            })
            .map_err(|e| Error::Internal {
                message: format!("cannot start the probe thread: {e}"),
            })?;
        Ok(Self { requests: tx })
    }

    pub(super) async fn probe(&self) -> Result<ProbeReport> {
        let (tx, rx) = oneshot::channel();
        let dead = || Error::Internal {
            message: "the probe thread died".into(),
        };
        self.requests
            .send(ProbeRequest::Full(tx))
            .map_err(|_| dead())?;
        rx.await.map_err(|_| dead())
    }

    /// The RDMA ports' states only; `None` if the probe thread is gone.
    pub(super) async fn port_states(&self) -> Option<Vec<PortStateRead>> {
        let (tx, rx) = oneshot::channel();
        self.requests.send(ProbeRequest::PortStates(tx)).ok()?;
        rx.await.ok()
    }
}
