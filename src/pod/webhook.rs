//! `fabricgate webhook`: a mutating admission webhook that wires `fabricgate preflight` into
//! opted-in training pods. For each pod it adds a required node affinity on
//! `fabricgate.io/ready=true` (tolerations, even blanket ones, cannot get around it), the
//! preflight init container (same image, the pod's RDMA resources, the pod's mounts of the
//! required paths), a small in-memory `emptyDir` for the NCCL files, and `NCCL_CONF_FILE` on
//! every container. The mutation is a pure function of the pod ([`mutate`]); the server
//! ([`serve`]) is axum over rustls, with the certificate reloaded when its files change.
//!
//! Opt-in: the pod label `fabricgate.io/preflight: "true"`, or (namespace opt-in, through the
//! webhook configuration's namespace selector) any pod that requests an RDMA resource. The
//! label `"false"` opts a pod out. A pod that sets `NCCL_NET=Socket` itself is left alone,
//! with an admission warning. No side effects: the webhook reads nothing but the request.

use crate::config::Config;
use crate::error::{Error, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Name of the init container the webhook adds.
pub const INIT_CONTAINER: &str = "fabricgate-preflight";
/// Name of the `emptyDir` volume holding `nccl.conf` and `nccl.env`.
pub const VOLUME: &str = "fabricgate-nccl";
/// Where that volume is mounted in every container (`--nccl-dir` of preflight).
pub const DEFAULT_NCCL_DIR: &str = "/fabricgate";
/// Environment variable the init container reads the requirements from.
pub const REQUIREMENTS_ENV: &str = "FABRICGATE_REQUIREMENTS";
/// The HTTP path of the admission endpoint.
pub const MUTATE_PATH: &str = "/mutate";

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
    /// The requirements file's text, handed to preflight in [`REQUIREMENTS_ENV`].
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
        Self {
            image: image.to_owned(),
            requirements_yaml: yaml.to_owned(),
            required_paths,
            label_prefix: config.node.label_prefix.clone(),
            rdma_resource_prefixes: DEFAULT_RDMA_RESOURCE_PREFIXES
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            nccl_dir: DEFAULT_NCCL_DIR.to_owned(),
            preflight_args: Vec::new(),
        }
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
    /// RFC 6902 operations; empty when nothing is to change (not opted in, opted out, left
    /// alone, or already mutated).
    pub patch: Vec<Value>,
    /// Admission warnings for the client (`kubectl` prints them).
    pub warnings: Vec<String>,
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

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

fn has_env(container: &Value, name: &str) -> bool {
    container["env"]
        .as_array()
        .is_some_and(|env| env.iter().any(|e| e["name"] == name))
}

fn named<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|v| v["name"] == name)
}

/// A container that chose the socket transport for NCCL itself, and how.
fn socket_choice(container: &Value) -> Option<String> {
    if let Some(net) = env_value(container, "NCCL_NET").filter(|v| v.eq_ignore_ascii_case("socket"))
    {
        return Some(format!("NCCL_NET={net}"));
    }
    env_value(container, "NCCL_IB_DISABLE")
        .filter(|v| v.trim() == "1")
        .map(|v| format!("NCCL_IB_DISABLE={v}"))
}

/// A quantity as an integer where it is one (device counts are); `None` otherwise.
fn count(q: &Value) -> Option<u64> {
    match q {
        Value::String(s) => s.trim().parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// The largest request and limit of each RDMA resource over the pod's containers.
fn rdma_resources(
    containers: &[Value],
    cfg: &MutationConfig,
) -> (
    serde_json::Map<String, Value>,
    serde_json::Map<String, Value>,
) {
    let mut requests = serde_json::Map::new();
    let mut limits = serde_json::Map::new();
    for c in containers {
        for (section, out) in [("requests", &mut requests), ("limits", &mut limits)] {
            let Some(map) = c["resources"][section].as_object() else {
                continue;
            };
            for (name, q) in map.iter().filter(|(n, _)| cfg.is_rdma_resource(n)) {
                let bigger = match out.get(name) {
                    None => true,
                    Some(old) => count(q).unwrap_or(0) > count(old).unwrap_or(0),
                };
                if bigger {
                    out.insert(name.clone(), q.clone());
                }
            }
        }
    }
    // Extended resources need a limit equal to the request; fill whichever is missing.
    for (name, q) in requests.clone() {
        limits.entry(name).or_insert(q);
    }
    for (name, q) in limits.clone() {
        requests.entry(name).or_insert(q);
    }
    (requests, limits)
}

fn uses_rdma(container: &Value, cfg: &MutationConfig) -> bool {
    ["requests", "limits"].iter().any(|s| {
        container["resources"][*s]
            .as_object()
            .is_some_and(|m| m.keys().any(|k| cfg.is_rdma_resource(k)))
    })
}

/// Whether `path` is `mount` or lies beneath it.
fn covers(mount: &str, path: &str) -> bool {
    let mount = mount.trim_end_matches('/');
    let path = path.trim_end_matches('/');
    path == mount || mount.is_empty() || path.starts_with(&format!("{mount}/"))
}

/// The pod's volume mounts that bring in a required path, so preflight checks the same
/// mounts the workers will use (first container that has one wins; one copy per mountPath).
fn required_mounts(containers: &[Value], cfg: &MutationConfig) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for path in &cfg.required_paths {
        let found = containers.iter().find_map(|c| {
            c["volumeMounts"].as_array()?.iter().find(|m| {
                m["mountPath"]
                    .as_str()
                    .is_some_and(|mp| covers(mp, path) || covers(path, mp))
            })
        });
        if let Some(m) = found
            && !out.iter().any(|o| o["mountPath"] == m["mountPath"])
        {
            out.push(m.clone());
        }
    }
    out
}

fn init_container(pod_containers: &[Value], cfg: &MutationConfig) -> Value {
    let (mut requests, mut limits) = rdma_resources(pod_containers, cfg);
    // requests == limits: a Guaranteed pod stays Guaranteed.
    for map in [&mut requests, &mut limits] {
        map.insert("cpu".into(), json!("500m"));
        map.insert("memory".into(), json!("256Mi"));
    }
    let worker = pod_containers
        .iter()
        .find(|c| uses_rdma(c, cfg))
        .or_else(|| pod_containers.first());
    let mut mounts = vec![json!({"name": VOLUME, "mountPath": cfg.nccl_dir})];
    mounts.extend(required_mounts(pod_containers, cfg));
    let mut args = vec![
        json!("preflight"),
        json!("--nccl-dir"),
        json!(cfg.nccl_dir),
        json!("--termination-log"),
        json!("/dev/termination-log"),
    ];
    args.extend(cfg.preflight_args.iter().map(|a| json!(a)));
    let mut c = json!({
        "name": INIT_CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "env": [{"name": REQUIREMENTS_ENV, "value": cfg.requirements_yaml}],
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    });
    // The worker's user and capabilities (IPC_LOCK): preflight sees what the worker will.
    if let Some(sc) = worker
        .map(|w| &w["securityContext"])
        .filter(|s| s.is_object())
    {
        c["securityContext"] = sc.clone();
    }
    c
}

fn affinity_ops(spec: &Value, cfg: &MutationConfig, ops: &mut Vec<Value>) {
    let key = cfg.ready_label();
    let expr = json!({"key": key, "operator": "In", "values": ["true"]});
    let term = json!({"matchExpressions": [expr]});
    let required_path =
        "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution";
    let affinity = &spec["affinity"];
    if !affinity.is_object() {
        ops.push(json!({"op": "add", "path": "/spec/affinity", "value":
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [term]}}}}));
        return;
    }
    let node = &affinity["nodeAffinity"];
    if !node.is_object() {
        ops.push(
            json!({"op": "add", "path": "/spec/affinity/nodeAffinity", "value":
            {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}),
        );
        return;
    }
    let required = &node["requiredDuringSchedulingIgnoredDuringExecution"];
    if !required.is_object() {
        ops.push(json!({"op": "add", "path": required_path,
            "value": {"nodeSelectorTerms": [term]}}));
        return;
    }
    match required["nodeSelectorTerms"].as_array() {
        None => ops.push(
            json!({"op": "add", "path": format!("{required_path}/nodeSelectorTerms"),
            "value": [term]}),
        ),
        Some(terms) if terms.is_empty() => ops.push(json!({"op": "add",
            "path": format!("{required_path}/nodeSelectorTerms/-"), "value": term})),
        // Terms are ORed: the requirement goes into every one of them.
        Some(terms) => {
            for (i, t) in terms.iter().enumerate() {
                let exprs = t["matchExpressions"].as_array();
                if exprs.is_some_and(|e| e.iter().any(|x| x["key"] == key)) {
                    continue;
                }
                let base = format!("{required_path}/nodeSelectorTerms/{i}/matchExpressions");
                ops.push(match exprs {
                    Some(_) => json!({"op": "add", "path": format!("{base}/-"), "value": expr}),
                    None => json!({"op": "add", "path": base, "value": [expr]}),
                });
            }
        }
    }
}

/// The patch for one pod (a `v1.Pod` as JSON). Pure: the same pod gives the same patch, and
/// a pod this function already mutated gives an empty one (reinvocation adds only what
/// another webhook's change made missing, e.g. `NCCL_CONF_FILE` on a container it added).
pub fn mutate(pod: &Value, cfg: &MutationConfig) -> Mutation {
    let mut m = Mutation::default();
    let label = pod["metadata"]["labels"][cfg.opt_in_label()].as_str();
    if label == Some("false") {
        return m;
    }
    let spec = &pod["spec"];
    let containers: Vec<Value> = spec["containers"].as_array().cloned().unwrap_or_default();
    if containers.is_empty() {
        return m;
    }
    let any_rdma = containers.iter().any(|c| uses_rdma(c, cfg));
    if label != Some("true") && !any_rdma {
        return m; // namespace opt-in, but this pod uses no RDMA
    }
    let name = pod["metadata"]["name"]
        .as_str()
        .or_else(|| pod["metadata"]["generateName"].as_str())
        .unwrap_or("pod");
    for c in &containers {
        if let Some(how) = socket_choice(c) {
            m.warnings.push(format!(
                "fabricgate: {name} container {}: {how} makes NCCL use TCP sockets; pre-flight \
                 was not added and this pod's collectives will not use RDMA",
                c["name"].as_str().unwrap_or("?")
            ));
            return m;
        }
    }

    let mut ops: Vec<Value> = Vec::new();
    affinity_ops(spec, cfg, &mut ops);

    if !spec["volumes"].is_array() {
        ops.push(json!({"op": "add", "path": "/spec/volumes", "value": []}));
    }
    if named(&spec["volumes"], VOLUME).is_none() {
        ops.push(json!({"op": "add", "path": "/spec/volumes/-", "value":
            {"name": VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}}));
    }

    if named(&spec["initContainers"], INIT_CONTAINER).is_none() {
        let init = init_container(&containers, cfg);
        if spec["initContainers"].is_array() {
            // First: fail before anything else of the pod runs.
            ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": init}));
        } else {
            ops.push(json!({"op": "add", "path": "/spec/initContainers", "value": [init]}));
        }
    }

    let conf = cfg.nccl_conf_file();
    for (i, c) in containers.iter().enumerate() {
        let cname = c["name"].as_str().unwrap_or("?");
        match env_value(c, "NCCL_CONF_FILE") {
            Some(v) if v != conf => m.warnings.push(format!(
                "fabricgate: {name} container {cname} sets NCCL_CONF_FILE={v} itself; the \
                 validated NCCL configuration ({conf}) is not used there"
            )),
            _ if has_env(c, "NCCL_CONF_FILE") => {}
            _ => {
                let var = json!({"name": "NCCL_CONF_FILE", "value": conf});
                ops.push(if c["env"].is_array() {
                    json!({"op": "add", "path": format!("/spec/containers/{i}/env/-"), "value": var})
                } else {
                    json!({"op": "add", "path": format!("/spec/containers/{i}/env"), "value": [var]})
                });
            }
        }
        if let Some(hca) = env_value(c, "NCCL_IB_HCA") {
            m.warnings.push(format!(
                "fabricgate: {name} container {cname} sets NCCL_IB_HCA={hca} itself; it \
                 overrides the validated port list"
            ));
        }
        if named(&c["volumeMounts"], VOLUME).is_none() {
            let mount = json!({"name": VOLUME, "mountPath": cfg.nccl_dir, "readOnly": true});
            ops.push(if c["volumeMounts"].is_array() {
                json!({"op": "add", "path": format!("/spec/containers/{i}/volumeMounts/-"),
                    "value": mount})
            } else {
                json!({"op": "add", "path": format!("/spec/containers/{i}/volumeMounts"),
                    "value": [mount]})
            });
        }
    }
    m.patch = ops;
    m
}

/// Answer one `AdmissionReview` (the request body) with the review to send back.
///
/// # Errors
/// [`Error::Usage`] when the body is not an `AdmissionReview` with a request; the server
/// answers 400 with the message.
pub fn review(body: &[u8], cfg: &MutationConfig) -> Result<Value> {
    let review = answer(body, cfg)?;
    let mut out = serde_json::to_value(&review).map_err(|e| Error::Internal {
        message: format!("cannot serialize the AdmissionReview: {e}"),
    })?;
    // kube-core serializes the patch bytes as a number array; the API's own (Go) encoding
    // of []byte is a base64 string, which is what every client expects.
    if let Some(bytes) = review.response.as_ref().and_then(|r| r.patch.clone()) {
        out["response"]["patch"] =
            serde_json::to_value(k8s_openapi::ByteString(bytes)).map_err(|e| Error::Internal {
                message: format!("cannot encode the patch: {e}"),
            })?;
    }
    Ok(out)
}

fn answer(body: &[u8], cfg: &MutationConfig) -> Result<AdmissionReview<DynamicObject>> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| Error::Usage {
            flag: "request body".into(),
            message: format!("not an AdmissionReview: {e}"),
        })?;
    let request: AdmissionRequest<DynamicObject> = review.try_into().map_err(|_| Error::Usage {
        flag: "request body".into(),
        message: "the AdmissionReview has no request".into(),
    })?;
    let mut response = AdmissionResponse::from(&request);
    let is_pod = request.kind.kind == "Pod" && request.kind.group.is_empty();
    if !is_pod || request.operation != Operation::Create || request.sub_resource.is_some() {
        return Ok(response.into_review());
    }
    let Some(object) = &request.object else {
        return Ok(response.into_review());
    };
    let pod = serde_json::to_value(object).map_err(|e| Error::Internal {
        message: format!("cannot serialize the pod: {e}"),
    })?;
    let mutation = mutate(&pod, cfg);
    if !mutation.warnings.is_empty() {
        response.warnings = Some(mutation.warnings.clone());
    }
    if !mutation.patch.is_empty() {
        response = response
            .with_patch(mutation.json_patch()?)
            .map_err(|e| Error::Internal {
                message: format!("cannot serialize the patch: {e}"),
            })?;
    }
    Ok(response.into_review())
}

// ---- TLS ---------------------------------------------------------------------------------

/// The serving certificate, read from PEM files and swapped in when they change (a
/// cert-manager renewal rewrites the Secret volume's files in place).
#[derive(Debug)]
pub struct CertReloader {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The PEM bytes `current` came from, to notice a change.
    loaded_from: RwLock<(Vec<u8>, Vec<u8>)>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_error(path: &Path, message: String) -> Error {
    Error::Usage {
        flag: "--tls-cert-file/--tls-key-file".into(),
        message: format!("{}: {message}", path.display()),
    }
}

fn certified_key(
    cert_file: &Path,
    key_file: &Path,
    cert: &[u8],
    key: &[u8],
) -> Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| tls_error(cert_file, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(tls_error(cert_file, "holds no certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| tls_error(key_file, format!("not a PEM private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| tls_error(key_file, format!("unusable private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match()
        .map_err(|e| tls_error(key_file, format!("does not match the certificate: {e}")))?;
    Ok(ck)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| tls_error(path, format!("cannot read: {e}")))
}

impl CertReloader {
    /// Load the certificate and key.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the file when either is unreadable, not PEM, or they do not
    /// belong together.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Self> {
        let (cert, key) = (read(cert_file)?, read(key_file)?);
        let ck = certified_key(cert_file, key_file, &cert, &key)?;
        Ok(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(Arc::new(ck)),
            loaded_from: RwLock::new((cert, key)),
        })
    }

    /// Re-read the files; swap the certificate in when they changed and are valid.
    /// `Ok(true)` when a new certificate is now served.
    ///
    /// # Errors
    /// The load error when the files changed but are not usable; the old certificate stays.
    pub fn reload(&self) -> Result<bool> {
        let (cert, key) = (read(&self.cert_file)?, read(&self.key_file)?);
        let unchanged = self
            .loaded_from
            .read()
            .map(|l| l.0 == cert && l.1 == key)
            .unwrap_or(false);
        if unchanged {
            return Ok(false);
        }
        let ck = certified_key(&self.cert_file, &self.key_file, &cert, &key)?;
        if let Ok(mut current) = self.current.write() {
            *current = Arc::new(ck);
        }
        if let Ok(mut from) = self.loaded_from.write() {
            *from = (cert, key);
        }
        Ok(true)
    }
}

impl ResolvesServerCert for CertReloader {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| Arc::clone(&c))
    }
}

// ---- the server --------------------------------------------------------------------------

/// Everything [`serve`] needs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub mutation: MutationConfig,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// How often the certificate files are checked for a change.
    pub reload_interval: Duration,
}

async fn mutate_handler(State(cfg): State<Arc<MutationConfig>>, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    match review(&body, &cfg) {
        Ok(review) => {
            let patched = review["response"]["patch"].is_string();
            tracing::debug!(
                patched,
                micros = started.elapsed().as_micros() as u64,
                "admission review answered"
            );
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                review.to_string(),
            )
                .into_response()
        }
        Err(e) => {
            tracing::warn!("bad admission request: {e}");
            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
        }
    }
}

/// The HTTP routes: `POST /mutate` (AdmissionReview v1) and `GET /healthz`.
pub fn router(cfg: MutationConfig) -> Router {
    Router::new()
        .route(MUTATE_PATH, post(mutate_handler))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Arc::new(cfg))
}

/// Serve the webhook over TLS on `listener` until `shutdown` completes. The certificate is
/// loaded before the first connection (a bad one is an error here, not a failing handshake)
/// and re-read every `reload_interval`; a broken replacement is logged and the old one kept.
///
/// # Errors
/// The certificate load error at start.
pub async fn serve(
    config: ServerConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let resolver = Arc::new(CertReloader::load(&config.cert_file, &config.key_file)?);
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Internal {
            message: format!("TLS setup: {e}"),
        })?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let app = router(config.mutation.clone());

    let reloader = {
        let resolver = resolver.clone();
        let every = config.reload_interval.max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match resolver.reload() {
                    Ok(true) => tracing::info!("reloaded the TLS certificate"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("keeping the current TLS certificate: {e}"),
                }
            }
        })
    };

    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp));
            let stream = match handshake.await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!("TLS handshake failed: {e}");
                    return;
                }
                Err(_) => return,
            };
            let service =
                hyper::service::service_fn(move |req| tower::ServiceExt::oneshot(app.clone(), req));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    reloader.abort();
    Ok(())
}

// ---- the webhook configuration -------------------------------------------------------------

/// Where the API server reaches the webhook.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// `url: https://127.0.0.1:PORT/mutate` (tests, or a webhook outside the cluster).
    Url(String),
    /// A Service in the cluster (the deploy/ manifest).
    Service {
        namespace: String,
        name: String,
        port: u16,
    },
}

/// The `MutatingWebhookConfiguration` (admissionregistration.k8s.io/v1), as JSON. Two
/// webhooks: namespaces labelled `<prefix>preflight: "true"` (every pod there that requests
/// RDMA, `failurePolicy: Fail`), and pods labelled so in other namespaces
/// (`failurePolicy: Ignore`: a webhook outage does not block namespaces that did not opt in).
/// `ca_bundle_pem` is the CA that signed the serving certificate (PEM).
pub fn webhook_configuration(
    name: &str,
    endpoint: &Endpoint,
    ca_bundle_pem: &[u8],
    label_prefix: &str,
    exempt_namespaces: &[&str],
) -> Value {
    // ByteString serializes as base64, as the API wants `caBundle`.
    let ca = serde_json::to_value(k8s_openapi::ByteString(ca_bundle_pem.to_vec()))
        .unwrap_or(Value::Null);
    let mut client = match endpoint {
        Endpoint::Url(url) => json!({"url": format!("{}{MUTATE_PATH}", url.trim_end_matches('/'))}),
        Endpoint::Service {
            namespace,
            name,
            port,
        } => json!({"service": {"namespace": namespace, "name": name, "port": port,
            "path": MUTATE_PATH}}),
    };
    client["caBundle"] = ca;
    let label = format!("{label_prefix}preflight");
    let rules = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
        "resources": ["pods"], "scope": "Namespaced"}]);
    let not_exempt = json!({"key": "kubernetes.io/metadata.name", "operator": "NotIn",
        "values": exempt_namespaces});
    let common = |hook: &str, failure: &str, ns: Value, obj: Value| {
        json!({
            "name": hook,
            "admissionReviewVersions": ["v1"],
            "clientConfig": client,
            "rules": rules,
            "failurePolicy": failure,
            "matchPolicy": "Equivalent",
            "namespaceSelector": ns,
            "objectSelector": obj,
            "sideEffects": "None",
            "timeoutSeconds": 5,
            "reinvocationPolicy": "IfNeeded",
        })
    };
    let domain = label_prefix.trim_end_matches('/');
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            common(
                &format!("namespaces.preflight.{domain}"),
                "Fail",
                json!({"matchExpressions": [
                    {"key": label, "operator": "In", "values": ["true"]}, not_exempt]}),
                json!({"matchExpressions": [
                    {"key": label, "operator": "NotIn", "values": ["false"]}]}),
            ),
            common(
                &format!("pods.preflight.{domain}"),
                "Ignore",
                json!({"matchExpressions": [
                    {"key": label, "operator": "NotIn", "values": ["true"]}, not_exempt]}),
                json!({"matchLabels": {label.clone(): "true"}}),
            ),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MutationConfig {
        let config =
            Config::parse("lustre:\n  mounts: [/lustre/scratch]\n").expect("valid requirements");
        MutationConfig::new(&config, "lustre:\n  mounts: [/lustre/scratch]\n", "img:1")
    }

    #[test]
    fn covers_is_path_aware() {
        assert!(covers("/lustre", "/lustre/scratch"));
        assert!(covers("/lustre/scratch/", "/lustre/scratch"));
        assert!(!covers("/lus", "/lustre/scratch"));
        assert!(covers("/", "/lustre"));
    }

    #[test]
    fn rdma_resources_take_the_largest_and_pair_limits() {
        let c = cfg();
        let containers = vec![
            json!({"resources": {"limits": {"rdma/ib": "2", "nvidia.com/gpu": "8"}}}),
            json!({"resources": {"requests": {"rdma/ib": 4}}}),
        ];
        let (req, lim) = rdma_resources(&containers, &c);
        assert_eq!(req["rdma/ib"], json!(4));
        assert_eq!(lim["rdma/ib"], json!("2"));
        assert!(!req.contains_key("nvidia.com/gpu"));
    }

    #[test]
    fn socket_choice_is_case_insensitive() {
        let c = json!({"env": [{"name": "NCCL_NET", "value": "socket"}]});
        assert_eq!(socket_choice(&c).as_deref(), Some("NCCL_NET=socket"));
        let c = json!({"env": [{"name": "NCCL_IB_DISABLE", "value": "1"}]});
        assert!(socket_choice(&c).is_some());
        let c = json!({"env": [{"name": "NCCL_NET", "value": "IB"}]});
        assert!(socket_choice(&c).is_none());
    }
}
