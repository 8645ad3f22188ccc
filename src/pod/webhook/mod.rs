//! `fabricgate webhook`: a mutating admission webhook that wires `fabricgate preflight` into
//! opted-in training pods. For each pod it adds a required node affinity on
//! `fabricgate.io/ready=true` to every `nodeSelectorTerm` (tolerations, even blanket ones,
//! and the pod's own expressions on that key cannot get around it), the preflight init
//! container (same image, the pod's RDMA resources, the pod's mounts of the required paths), a
//! small in-memory `emptyDir` for the NCCL files, `NCCL_CONF_FILE` on every container and an
//! explicit `NCCL_NET` naming a verbs transport on every container that requests RDMA. The
//! mutation is a pure function of the pod ([`mutate`]); the server ([`serve`]) is axum over
//! rustls within the bounds of [`crate::observe::server`], with the certificate reloaded when
//! its files change.
//!
//! Opt-in: the pod label `fabricgate.io/preflight: "true"`, or (namespace opt-in, through the
//! webhook configuration's namespace selector) any pod that requests an RDMA resource. The
//! label `"false"` opts a pod out. A pod that argues — `NCCL_NET` set to something else or
//! through `valueFrom`, `NCCL_IB_DISABLE` that NCCL reads as true, its own `NCCL_IB_HCA`, a
//! mount of its own where the NCCL files go — is refused with a message saying what to remove
//! (docs/preflight.md, "What the webhook refuses"). No side effects: the webhook reads nothing
//! but the request.

use crate::config::Config;
use crate::config::webhook::WebhookSettings;
use crate::error::{Error, Result};
use serde_json::Value;

mod configuration;
mod mutate;
mod nccl;
mod review;
mod server;
#[cfg(test)]
mod tests;
mod tls;

pub use configuration::{Endpoint, webhook_configuration};
pub use mutate::mutate;
pub use nccl::{NcclInt, nccl_int};
pub use review::review;
pub use server::{DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT, ServerConfig, router, serve};
pub use tls::CertReloader;

/// Name of the init container the webhook adds (`-1`, `-2`, ... appended when the pod
/// already uses the name for a container of its own).
pub const INIT_CONTAINER: &str = "fabricgate-preflight";
/// Name of the `emptyDir` volume holding `nccl.conf` and `nccl.env` (suffixed likewise).
pub const VOLUME: &str = "fabricgate-nccl";
/// Where that volume is mounted in every container (`--nccl-dir` of preflight).
pub const DEFAULT_NCCL_DIR: &str = "/fabricgate";
/// Environment variable the init container reads the requirements from.
pub const REQUIREMENTS_ENV: &str = "FABRICGATE_REQUIREMENTS";
/// Largest requirements text handed to preflight in [`REQUIREMENTS_ENV`]: well inside the
/// kernel's 128 KiB per environment string (`MAX_ARG_STRLEN`) and its total for arguments
/// and environment. A longer requirements file is passed in its compact form (JSON, no
/// comments); one whose compact form is longer still is refused at start
/// ([`MutationConfig::check`]).
pub const MAX_REQUIREMENTS_BYTES: usize = 32 * 1024;
/// The HTTP path of the admission endpoint.
pub const MUTATE_PATH: &str = "/mutate";
/// The only `AdmissionReview` version served.
pub const ADMISSION_API_VERSION: &str = "admission.k8s.io/v1";

/// Resource-name prefixes that mean "this container gets RDMA devices": the RDMA shared
/// device plugin (`rdma/...`), NVIDIA's network operator (`nvidia.com/hostdev`,
/// `nvidia.com/rdma...`, SR-IOV `nvidia.com/sriov...`), and the older `mellanox.com/`.
pub const DEFAULT_RDMA_RESOURCE_PREFIXES: [&str; 5] = [
    "rdma/",
    "nvidia.com/hostdev",
    "nvidia.com/rdma",
    "nvidia.com/sriov",
    "mellanox.com/",
];

/// What the mutation adds, and how it recognizes RDMA pods.
#[derive(Debug, Clone)]
pub struct MutationConfig {
    /// Image of the preflight init container (the webhook's own image).
    pub image: String,
    /// The requirements as preflight gets them in [`REQUIREMENTS_ENV`]: the file's text, or
    /// its compact form when the text is over [`MAX_REQUIREMENTS_BYTES`].
    pub requirements_yaml: String,
    /// Mount paths the requirements name (`lustre.mounts`, `mounts[].path`).
    pub required_paths: Vec<String>,
    /// `fabricgate.io/`: the opt-in label is `<prefix>preflight`, the affinity
    /// `<prefix>ready`.
    pub label_prefix: String,
    pub rdma_resource_prefixes: Vec<String>,
    /// Mount path of the NCCL volume in every container.
    pub nccl_dir: String,
    /// Extra arguments for `fabricgate preflight` (e.g. `--min-memlock=1GiB`).
    pub preflight_args: Vec<String>,
    /// `webhook:` of the requirements: the verbs transports a container may name in
    /// `NCCL_NET` (the first is set where it names none), and whether it may set
    /// `NCCL_IB_HCA`.
    pub settings: WebhookSettings,
}

impl MutationConfig {
    /// The mutation for a requirements file (`yaml` is its text, `config` the parsed form).
    pub fn new(config: &Config, yaml: &str, image: &str) -> Self {
        let required_paths = config
            .lustre
            .mounts
            .iter()
            .cloned()
            .chain(config.mounts.iter().map(|m| m.path.clone()))
            .collect();
        let requirements = if yaml.len() <= MAX_REQUIREMENTS_BYTES {
            yaml.to_owned()
        } else {
            // JSON is YAML: preflight parses it as it would the file, without the comments.
            serde_json::to_string(config).unwrap_or_else(|_| yaml.to_owned())
        };
        Self {
            image: image.to_owned(),
            requirements_yaml: requirements,
            required_paths,
            label_prefix: config.node.label_prefix.clone(),
            rdma_resource_prefixes: DEFAULT_RDMA_RESOURCE_PREFIXES
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            nccl_dir: DEFAULT_NCCL_DIR.to_owned(),
            preflight_args: Vec::new(),
            settings: config.webhook.clone(),
        }
    }

    /// Whether preflight can be started with these requirements.
    ///
    /// # Errors
    /// [`Error::Usage`] when the requirements, even in compact form, are longer than
    /// [`MAX_REQUIREMENTS_BYTES`].
    pub fn check(&self) -> Result<()> {
        let len = self.requirements_yaml.len();
        if len > MAX_REQUIREMENTS_BYTES {
            return Err(Error::Usage {
                flag: "--config".into(),
                message: format!(
                    "the requirements are {len} bytes even without comments; preflight gets \
                     them in one environment variable of at most {MAX_REQUIREMENTS_BYTES} \
                     bytes (exec limits); shorten them (fewer keys, shorter globs)"
                ),
            });
        }
        Ok(())
    }

    fn opt_in_label(&self) -> String {
        format!("{}preflight", self.label_prefix)
    }

    fn ready_label(&self) -> String {
        format!("{}ready", self.label_prefix)
    }

    fn nccl_conf_file(&self) -> String {
        format!(
            "{}/{}",
            self.nccl_dir.trim_end_matches('/'),
            crate::pod::preflight::NCCL_CONF
        )
    }

    fn is_rdma_resource(&self, name: &str) -> bool {
        self.rdma_resource_prefixes
            .iter()
            .any(|p| name.starts_with(p.as_str()))
    }
}

/// The outcome of [`mutate`] on one pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mutation {
    /// RFC 6902 operations; empty when nothing is to change (not opted in, opted out,
    /// already mutated, or refused).
    pub patch: Vec<Value>,
    /// Admission warnings for the client (`kubectl` prints them).
    pub warnings: Vec<String>,
    /// Why the pod is refused (what to remove); `None`: admitted.
    pub refusal: Option<String>,
}

impl Mutation {
    /// The operations as a `json_patch::Patch`.
    ///
    /// # Errors
    /// [`Error::Internal`] if an operation is malformed (a bug).
    pub fn json_patch(&self) -> Result<json_patch::Patch> {
        serde_json::from_value(Value::Array(self.patch.clone())).map_err(|e| Error::Internal {
            message: format!("webhook built an invalid JSON patch: {e}"),
        })
    }
}
