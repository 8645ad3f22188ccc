//! The mutation: a pure function of the pod.

use super::nccl::ib_disable_problem;
use super::{INIT_CONTAINER, Mutation, MutationConfig, REQUIREMENTS_ENV, VOLUME};
use serde_json::{Value, json};

/// The env entries of `container` named `name` (Kubernetes allows repeats; the last wins).
fn env_entries<'a>(container: &'a Value, name: &str) -> impl Iterator<Item = &'a Value> {
    let name = name.to_owned();
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(move |e| e["name"] == name.as_str())
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    env_entries(container, name)
        .last()
        .and_then(|e| e["value"].as_str())
}

fn has_env(container: &Value, name: &str) -> bool {
    env_entries(container, name).next().is_some()
}

fn names(list: &Value) -> impl Iterator<Item = &str> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
}

/// Containers, init containers, then ephemeral containers, in that order.
fn all_containers(spec: &Value) -> impl Iterator<Item = &Value> {
    ["containers", "initContainers", "ephemeralContainers"]
        .into_iter()
        .flat_map(move |k| spec[k].as_array().into_iter().flatten())
}

/// `base`, or `base-1`, `base-2`, ...: the first not in `taken`.
fn free_name(base: &str, taken: &[&str]) -> String {
    if !taken.contains(&base) {
        return base.to_owned();
    }
    (1..=taken.len())
        .map(|n| format!("{base}-{n}"))
        .find(|n| !taken.contains(&n.as_str()))
        .unwrap_or_else(|| format!("{base}-{}", taken.len() + 1))
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
pub(super) fn rdma_resources(
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
pub(super) fn covers(mount: &str, path: &str) -> bool {
    let mount = mount.trim_end_matches('/');
    let path = path.trim_end_matches('/');
    path == mount || mount.is_empty() || path.starts_with(&format!("{mount}/"))
}

fn same_dir(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
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
            && !same_dir(m["mountPath"].as_str().unwrap_or_default(), &cfg.nccl_dir)
            && !out.iter().any(|o| o["mountPath"] == m["mountPath"])
        {
            out.push(m.clone());
        }
    }
    out
}

/// The arguments of the preflight init container: with its image, what makes it ours.
fn preflight_args(cfg: &MutationConfig) -> Vec<Value> {
    let mut args = vec![
        json!("preflight"),
        json!("--nccl-dir"),
        json!(cfg.nccl_dir),
        json!("--termination-log"),
        json!("/dev/termination-log"),
    ];
    if !cfg.settings.default_nccl_net().eq_ignore_ascii_case("IB") {
        args.push(json!(format!(
            "--nccl-net={}",
            cfg.settings.default_nccl_net()
        )));
    }
    args.extend(cfg.preflight_args.iter().map(|a| json!(a)));
    args
}

fn requirements_env(cfg: &MutationConfig) -> Value {
    json!([{"name": REQUIREMENTS_ENV, "value": cfg.requirements_yaml}])
}

/// Whether `c` is a preflight init container this webhook added, by content (never by its
/// name, which a pod author chooses): this image, its entrypoint, these arguments, exactly
/// these requirements, run to completion before the workers (not a sidecar), with the NCCL
/// directory on an `emptyDir`. The name of that volume when it is.
fn ours(c: &Value, spec: &Value, cfg: &MutationConfig) -> Option<String> {
    let is = c["image"] == cfg.image.as_str()
        && c["command"].is_null()
        && c["args"] == Value::Array(preflight_args(cfg))
        && c["env"] == requirements_env(cfg)
        && c["envFrom"].as_array().is_none_or(Vec::is_empty)
        && c["restartPolicy"].is_null();
    if !is {
        return None;
    }
    let mount = c["volumeMounts"].as_array()?.iter().find(|m| {
        m["mountPath"]
            .as_str()
            .is_some_and(|p| same_dir(p, &cfg.nccl_dir))
            && m["subPath"].is_null()
    })?;
    let volume = mount["name"].as_str()?;
    spec["volumes"]
        .as_array()?
        .iter()
        .any(|v| v["name"] == volume && v["emptyDir"].is_object())
        .then(|| volume.to_owned())
}

fn init_container(
    name: &str,
    volume: &str,
    pod_containers: &[Value],
    cfg: &MutationConfig,
) -> Value {
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
    let mut mounts = vec![json!({"name": volume, "mountPath": cfg.nccl_dir})];
    mounts.extend(required_mounts(pod_containers, cfg));
    let mut c = json!({
        "name": name,
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "args": preflight_args(cfg),
        "env": requirements_env(cfg),
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

/// A term that says nothing matches no node: it cannot let the pod onto one, and adding the
/// readiness requirement to it would make it match.
fn empty_term(t: &Value) -> bool {
    ["matchExpressions", "matchFields"]
        .iter()
        .all(|k| t[*k].as_array().is_none_or(Vec::is_empty))
}

/// The readiness requirement in every ORed `nodeSelectorTerm`, whatever the term already says
/// about the key (`NotIn [x]`, `Exists`, `In [true, false]`: ANDed with ours, each still
/// needs `ready=true`). A term already holding exactly our expression is left as it is.
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
                if exprs.is_some_and(|e| e.contains(&expr)) || empty_term(t) {
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

/// What a container that runs NCCL over RDMA may not say: the sentences of the refusal.
fn nccl_problems(c: &Value, cfg: &MutationConfig, out: &mut Vec<String>) {
    let cname = c["name"].as_str().unwrap_or("?");
    let net = cfg.settings.default_nccl_net();
    for e in env_entries(c, "NCCL_NET") {
        match e["value"].as_str() {
            _ if !e["valueFrom"].is_null() => out.push(format!(
                "container {cname} sets NCCL_NET through valueFrom, which fabricgate cannot \
                 check; remove it (fabricgate sets NCCL_NET={net})"
            )),
            Some(v) if cfg.settings.allows_nccl_net(v) => {}
            v => out.push(format!(
                "container {cname} sets NCCL_NET={:?}, not a verbs transport ({}); remove it \
                 (fabricgate sets NCCL_NET={net}), or opt the pod out with the label {}: \
                 \"false\"",
                v.unwrap_or_default(),
                cfg.settings.nccl_net.join(", "),
                cfg.opt_in_label()
            )),
        }
    }
    for e in env_entries(c, "NCCL_IB_DISABLE") {
        let problem = match e["value"].as_str() {
            _ if !e["valueFrom"].is_null() => Some("NCCL_IB_DISABLE through valueFrom".into()),
            v => ib_disable_problem(v.unwrap_or_default()),
        };
        if let Some(p) = problem {
            out.push(format!(
                "container {cname} sets {p}; remove it: this pod must use the validated RDMA \
                 ports"
            ));
        }
    }
    if !cfg.settings.allow_user_ib_hca && has_env(c, "NCCL_IB_HCA") {
        out.push(format!(
            "container {cname} sets NCCL_IB_HCA itself, which overrides the ports preflight \
             validates; remove it (or allow it with webhook.allow_user_ib_hca)"
        ));
    }
}

/// One container to wire: its JSON pointer and whether it runs NCCL over RDMA.
struct Wired<'a> {
    path: String,
    c: &'a Value,
    nccl: bool,
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
    let inits: Vec<Value> = spec["initContainers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let rdma_workers = containers.iter().any(|c| uses_rdma(c, cfg));
    let any_rdma = rdma_workers || inits.iter().any(|c| uses_rdma(c, cfg));
    if label != Some("true") && !any_rdma {
        return m; // namespace opt-in, but this pod uses no RDMA
    }
    let name = pod["metadata"]["name"]
        .as_str()
        .or_else(|| pod["metadata"]["generateName"].as_str())
        .unwrap_or("pod");

    // Ours by content; otherwise the names to add it under (a pod's own container or volume
    // may hold the usual ones: names stay unique).
    let present = inits
        .iter()
        .enumerate()
        .find_map(|(i, c)| ours(c, spec, cfg).map(|v| (i, v)));
    let (volume, new_init) = match &present {
        Some((_, volume)) => (volume.clone(), None),
        None => {
            let (volume, init) = free_names(spec);
            (volume, Some(init))
        }
    };
    let present_at = present.as_ref().map(|(i, _)| *i);
    let wired = wired_containers(&containers, &inits, present_at, rdma_workers, cfg);

    let problems = refusals(spec, &wired, &volume, containers.len(), present_at, cfg);
    if !problems.is_empty() {
        m.refusal = Some(format!(
            "fabricgate: pod {name} is refused: {}",
            problems.join("; ")
        ));
        return m;
    }

    let mut ops: Vec<Value> = Vec::new();
    affinity_ops(spec, cfg, &mut ops);
    if new_init.is_some() {
        if !spec["volumes"].is_array() {
            ops.push(json!({"op": "add", "path": "/spec/volumes", "value": []}));
        }
        ops.push(json!({"op": "add", "path": "/spec/volumes/-", "value":
            {"name": volume, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}}));
    }
    for w in &wired {
        wire_ops(w, name, &volume, cfg, &mut ops, &mut m.warnings);
    }

    // Last: inserting at index 0 moves the init containers wired above.
    if let Some(init_name) = new_init {
        let init = init_container(&init_name, &volume, &containers, cfg);
        if spec["initContainers"].is_array() {
            // First: fail before anything else of the pod runs.
            ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": init}));
        } else {
            ops.push(json!({"op": "add", "path": "/spec/initContainers", "value": [init]}));
        }
    }
    m.patch = ops;
    m
}

/// The volume's and the init container's names where the pod has no preflight of ours yet:
/// the usual ones unless the pod's own volumes, mounts or containers hold them.
fn free_names(spec: &Value) -> (String, String) {
    // Nor a name some container already mounts (it would get the NCCL files).
    let volumes: Vec<&str> = names(&spec["volumes"])
        .chain(all_containers(spec).flat_map(|c| names(&c["volumeMounts"])))
        .collect();
    let taken: Vec<&str> = names(&spec["containers"])
        .chain(names(&spec["initContainers"]))
        .chain(names(&spec["ephemeralContainers"]))
        .collect();
    (
        free_name(VOLUME, &volumes),
        free_name(INIT_CONTAINER, &taken),
    )
}

/// The containers to wire: every worker, and the init containers that request RDMA (native
/// sidecars, `restartPolicy: Always`, included) but our own preflight at `present_at`.
fn wired_containers<'a>(
    containers: &'a [Value],
    inits: &'a [Value],
    present_at: Option<usize>,
    rdma_workers: bool,
    cfg: &MutationConfig,
) -> Vec<Wired<'a>> {
    let mut wired: Vec<Wired<'a>> = containers
        .iter()
        .enumerate()
        .map(|(i, c)| Wired {
            path: format!("/spec/containers/{i}"),
            c,
            // Opted in by label without an RDMA resource: every worker counts.
            nccl: uses_rdma(c, cfg) || !rdma_workers,
        })
        .collect();
    wired.extend(
        inits
            .iter()
            .enumerate()
            .filter(|(i, c)| present_at != Some(*i) && uses_rdma(c, cfg))
            .map(|(i, c)| Wired {
                path: format!("/spec/initContainers/{i}"),
                c,
                nccl: true,
            }),
    );
    wired
}

/// Why the pod is refused: NCCL settings that defeat the validation, a mount over the NCCL
/// files' directory, or a writable mount of our volume by anyone but our preflight (the
/// init container at `present_at`, after the pod's `workers` containers).
fn refusals(
    spec: &Value,
    wired: &[Wired<'_>],
    volume: &str,
    workers: usize,
    present_at: Option<usize>,
    cfg: &MutationConfig,
) -> Vec<String> {
    let mut problems = Vec::new();
    for w in wired {
        if w.nccl {
            nccl_problems(w.c, cfg, &mut problems);
        }
        let squatted = w.c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| {
                v["mountPath"]
                    .as_str()
                    .is_some_and(|p| same_dir(p, &cfg.nccl_dir))
                    && (v["name"] != volume || !v["subPath"].is_null())
            });
        if let Some(v) = squatted {
            problems.push(format!(
                "container {} mounts volume {} at {}, where fabricgate puts the validated \
                 NCCL files; mount it elsewhere",
                w.c["name"].as_str().unwrap_or("?"),
                v["name"].as_str().unwrap_or("?"),
                cfg.nccl_dir
            ));
        }
    }
    // Only preflight writes the NCCL files: every other mount of that volume is read-only.
    for (i, c) in all_containers(spec).enumerate() {
        let is_ours = present_at.is_some_and(|p| workers + p == i);
        let writable = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == volume && !is_ours && v["readOnly"] != true);
        if let Some(v) = writable {
            problems.push(format!(
                "container {} mounts fabricgate's volume {volume} writable at {}; remove that \
                 mount (fabricgate mounts it read-only at {})",
                c["name"].as_str().unwrap_or("?"),
                v["mountPath"].as_str().unwrap_or("?"),
                cfg.nccl_dir
            ));
        }
    }
    problems
}

/// The env (`NCCL_CONF_FILE`, and `NCCL_NET` where NCCL runs) and the read-only mount of
/// the NCCL files for one wired container of the pod `name`; warnings where the container's
/// own settings override the validated port list.
fn wire_ops(
    w: &Wired<'_>,
    name: &str,
    volume: &str,
    cfg: &MutationConfig,
    ops: &mut Vec<Value>,
    warnings: &mut Vec<String>,
) {
    let conf = cfg.nccl_conf_file();
    let net = cfg.settings.default_nccl_net();
    let cname = w.c["name"].as_str().unwrap_or("?");
    let mut env = Vec::new();
    match env_value(w.c, "NCCL_CONF_FILE") {
        Some(v) if v != conf => warnings.push(format!(
            "fabricgate: {name} container {cname} sets NCCL_CONF_FILE={v} itself; the \
             validated port list ({conf}) is not used there"
        )),
        _ if has_env(w.c, "NCCL_CONF_FILE") => {}
        _ => env.push(json!({"name": "NCCL_CONF_FILE", "value": conf})),
    }
    // Explicit env beats envFrom and the conf file: NCCL fails rather than fall back.
    if w.nccl && !has_env(w.c, "NCCL_NET") {
        env.push(json!({"name": "NCCL_NET", "value": net}));
    }
    if w.nccl
        && let Some(hca) = env_value(w.c, "NCCL_IB_HCA")
    {
        warnings.push(format!(
            "fabricgate: {name} container {cname} sets NCCL_IB_HCA={hca} itself; it \
             overrides the validated port list"
        ));
    }
    push_all(ops, &w.path, "env", w.c["env"].is_array(), env);
    let mounted = w.c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| {
            v["mountPath"]
                .as_str()
                .is_some_and(|p| same_dir(p, &cfg.nccl_dir))
        });
    if !mounted {
        let mount = json!({"name": volume, "mountPath": cfg.nccl_dir, "readOnly": true});
        let is_array = w.c["volumeMounts"].is_array();
        push_all(ops, &w.path, "volumeMounts", is_array, vec![mount]);
    }
}

/// Append `items` to the list `field` of the object at `path` (creating it when absent).
fn push_all(ops: &mut Vec<Value>, path: &str, field: &str, exists: bool, items: Vec<Value>) {
    if items.is_empty() {
        return;
    }
    if exists {
        for item in items {
            ops.push(json!({"op": "add", "path": format!("{path}/{field}/-"), "value": item}));
        }
    } else {
        ops.push(json!({"op": "add", "path": format!("{path}/{field}"), "value": items}));
    }
}
