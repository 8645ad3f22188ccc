//! PID → pod: the pod UID and container ID in `/proc/<pid>/cgroup`.
//!
//! The kubelet puts each pod in a cgroup named after its UID, and the runtime puts each
//! container in a child named after its ID. The shapes (one line per hierarchy on cgroup v1,
//! `0::PATH` on v2; the path the same on both):
//!
//! | driver   | pod cgroup                                                    | container cgroup                      |
//! |----------|---------------------------------------------------------------|---------------------------------------|
//! | systemd  | `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _>.slice` | `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` |
//! | cgroupfs | `kubepods/<qos>/pod<uid>`                                     | `<id>` (containerd), `crio-<id>` (CRI-O) |
//!
//! Guaranteed pods have no `<qos>` level. The path is relative to the reader's cgroup
//! namespace: the agent must run in the host's (as it runs in the host's PID namespace to see
//! the pods' QPs), or every path reads `/`.

use serde::Serialize;

/// The container runtime that named a container's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    Containerd,
    CriO,
    Docker,
}

/// A process's place in a pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodCgroup {
    /// The pod's UID as the API server writes it (dashes, not the systemd driver's `_`).
    pub pod_uid: String,
    /// `besteffort` or `burstable`; `None` for a Guaranteed pod (no QoS level in the path).
    pub qos: Option<String>,
    /// The container's ID (as in the pod status's `containerID` after `://`); `None` for a
    /// process in the pod's cgroup itself, or in CRI-O's `conmon` beside the containers.
    pub container_id: Option<String>,
    pub runtime: Option<Runtime>,
}

/// Whose cgroup a process is in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum CgroupOwner {
    Pod(PodCgroup),
    /// No path mentions `kubepods`: a host process (or a cgroup namespace that hides the path).
    Host,
    /// A `kubepods` path in a shape this parser does not know; the path is kept for the message.
    Unrecognized {
        path: String,
    },
}

/// Parse the text of `/proc/<pid>/cgroup`. The v2 line (`0::`) is read first, then the v1
/// lines in order; the first path that names a pod wins.
pub fn parse_proc_cgroup(text: &str) -> CgroupOwner {
    let mut paths: Vec<&str> = Vec::new();
    for line in text.lines() {
        // `hierarchy-ID:controller-list:path`; the path may itself contain ':'.
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(_controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if id == "0" {
            paths.insert(0, path);
        } else {
            paths.push(path);
        }
    }
    let mut unrecognized = None;
    for path in paths {
        match parse_path(path) {
            Some(pod) => return CgroupOwner::Pod(pod),
            None if unrecognized.is_none() && path.contains("kubepods") => {
                unrecognized = Some(path.to_owned());
            }
            None => {}
        }
    }
    match unrecognized {
        Some(path) => CgroupOwner::Unrecognized { path },
        None => CgroupOwner::Host,
    }
}

/// One cgroup path → the pod it names, if any: the component that carries the pod UID, and
/// the container component right below it.
///
/// The pod is the outermost component naming one, the kubelet's: a container that can write
/// its cgroupfs can create `kubepods-besteffort-pod<another pod's UID>.slice` below itself, and
/// a deeper match would credit its QPs, processes and network namespace to that other pod.
/// (A kubelet run inside another kubelet's pod is read as that outer pod, for the same reason.)
pub fn parse_path(path: &str) -> Option<PodCgroup> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (at, uid, qos) = parts.iter().enumerate().find_map(|(i, part)| {
        pod_component(part, i.checked_sub(1).and_then(|p| parts.get(p)).copied())
            .map(|(u, q)| (i, u, q))
    })?;
    let (container_id, runtime) = match parts.get(at + 1) {
        None => (None, None),
        Some(child) => {
            let (id, runtime) = container_component(child)?;
            (id, runtime)
        }
    };
    Some(PodCgroup {
        pod_uid: uid,
        qos,
        container_id,
        runtime,
    })
}

/// `kubepods-burstable-pod<uid_>.slice` (systemd) or `pod<uid>` (cgroupfs; its parent is the
/// QoS level or `kubepods`) → (UID, QoS).
fn pod_component(part: &str, parent: Option<&str>) -> Option<(String, Option<String>)> {
    if let Some(slice) = part.strip_suffix(".slice") {
        // The slice's name repeats its ancestors: `<...>kubepods[-<qos>]-pod<uid>`.
        let (prefix, uid) = slice.rsplit_once("-pod")?;
        let kubepods = prefix.rfind("kubepods")?;
        let qos = prefix[kubepods + "kubepods".len()..].strip_prefix('-');
        let uid = uid.replace('_', "-");
        return is_uid(&uid).then(|| (uid, qos.map(str::to_owned)));
    }
    let uid = part.strip_prefix("pod")?;
    let qos = match parent? {
        "kubepods" => None,
        q @ ("besteffort" | "burstable") => Some(q.to_owned()),
        _ => return None,
    };
    is_uid(uid).then(|| (uid.to_owned(), qos))
}

/// A container's cgroup → (ID, runtime); `Some((None, _))` for CRI-O's conmon, which is not
/// a container; `None` for a shape not known.
fn container_component(part: &str) -> Option<(Option<String>, Option<Runtime>)> {
    if let Some(scope) = part.strip_suffix(".scope") {
        if scope.starts_with("crio-conmon-") {
            return Some((None, Some(Runtime::CriO)));
        }
        let (id, runtime) = [
            ("cri-containerd-", Runtime::Containerd),
            ("crio-", Runtime::CriO),
            ("docker-", Runtime::Docker),
        ]
        .into_iter()
        .find_map(|(prefix, rt)| scope.strip_prefix(prefix).map(|id| (id, rt)))?;
        return is_container_id(id).then(|| (Some(id.to_owned()), Some(runtime)));
    }
    if let Some(id) = part.strip_prefix("crio-conmon-") {
        return is_container_id(id).then_some((None, Some(Runtime::CriO)));
    }
    if let Some(id) = part.strip_prefix("crio-") {
        return is_container_id(id).then(|| (Some(id.to_owned()), Some(Runtime::CriO)));
    }
    // cgroupfs with containerd (or dockershim): the bare ID; the runtime is not in the name.
    is_container_id(part).then(|| (Some(part.to_owned()), None))
}

/// Pod UIDs are UUIDs (36 characters) or, for static pods, 32 hex digits of a hash.
fn is_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 36
        && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        && !uid.starts_with('-')
}

/// Container IDs are 64 hex digits from every runtime here; shorter ones are accepted (test
/// set-ups name their own), anything not hex is not an ID.
fn is_container_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f";
    const CID: &str = "3b9e1f7a2c4d6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f9011223344556677a";

    fn fixture(name: &str) -> CgroupOwner {
        let path = format!(
            "{}/tests/fixtures/cgroup/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        parse_proc_cgroup(&std::fs::read_to_string(&path).unwrap())
    }

    fn pod(qos: Option<&str>, container: Option<&str>, runtime: Option<Runtime>) -> CgroupOwner {
        CgroupOwner::Pod(PodCgroup {
            pod_uid: UID.to_owned(),
            qos: qos.map(str::to_owned),
            container_id: container.map(str::to_owned),
            runtime,
        })
    }

    #[test]
    fn cgroup_v2_systemd_driver_containerd_and_crio() {
        assert_eq!(
            fixture("v2-systemd-containerd"),
            pod(Some("burstable"), Some(CID), Some(Runtime::Containerd))
        );
        assert_eq!(
            fixture("v2-systemd-crio-guaranteed"),
            pod(None, Some(CID), Some(Runtime::CriO))
        );
        // CRI-O's conmon sits in the pod beside the containers: the pod, no container.
        assert_eq!(
            fixture("v2-systemd-crio-conmon"),
            pod(Some("besteffort"), None, Some(Runtime::CriO))
        );
    }

    #[test]
    fn cgroup_v2_cgroupfs_driver_containerd_and_crio() {
        assert_eq!(
            fixture("v2-cgroupfs-containerd"),
            pod(Some("besteffort"), Some(CID), None)
        );
        assert_eq!(
            fixture("v2-cgroupfs-crio-guaranteed"),
            pod(None, Some(CID), Some(Runtime::CriO))
        );
    }

    #[test]
    fn cgroup_v1_one_line_per_hierarchy() {
        // Hybrid: `0::/` first, the v1 lines name the pod.
        assert_eq!(
            fixture("v1-systemd-containerd"),
            pod(Some("burstable"), Some(CID), Some(Runtime::Containerd))
        );
        // The rdma hierarchy at `/` does not hide the pod the others name.
        assert_eq!(
            fixture("v1-cgroupfs-crio"),
            pod(Some("besteffort"), Some(CID), Some(Runtime::CriO))
        );
    }

    #[test]
    fn host_processes_and_unknown_shapes() {
        assert_eq!(fixture("v2-host"), CgroupOwner::Host);
        assert_eq!(fixture("v2-root"), CgroupOwner::Host);
        assert_eq!(parse_proc_cgroup(""), CgroupOwner::Host);
        assert_eq!(
            parse_proc_cgroup("garbage without colons\n"),
            CgroupOwner::Host
        );
        let CgroupOwner::Unrecognized { path } = fixture("v2-unknown-shape") else {
            panic!("an unknown runtime's scope is not a container");
        };
        assert!(
            path.ends_with(&format!("unknown-runtime-{CID}.scope")),
            "{path}"
        );
        // A QoS cgroup with no pod below it, and a pod UID that is not hex.
        for path in [
            "0::/kubepods/burstable\n",
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podNOT_A_UID.slice\n",
            "0::/kubepods/burstable/podxyz/abc\n",
        ] {
            assert!(
                matches!(parse_proc_cgroup(path), CgroupOwner::Unrecognized { .. }),
                "{path}"
            );
        }
    }

    /// A container that writes its own cgroupfs creates another pod's slice (or cgroupfs
    /// directory) below itself and moves a process there: the process is still its own pod's,
    /// in its own container, never the victim's.
    #[test]
    fn redteam_a_pod_slice_nested_in_a_container_is_never_the_pod() {
        const VICTIM: &str = "0a0b0c0d-1111-2222-3333-444455556666";
        let systemd = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/\
             cri-containerd-{CID}.scope/kubepods-besteffort-pod{}.slice\n",
            UID.replace('-', "_"),
            VICTIM.replace('-', "_")
        );
        let cgroupfs =
            format!("0::/kubepods/besteffort/pod{UID}/{CID}/kubepods/besteffort/pod{VICTIM}/ab\n");
        for (text, runtime) in [(systemd, Some(Runtime::Containerd)), (cgroupfs, None)] {
            assert_eq!(
                parse_proc_cgroup(&text),
                pod(Some("besteffort"), Some(CID), runtime),
                "{text}"
            );
        }
    }

    /// What the Soft-RoCE VM staged (docs: /work/shared/notes/runtime-transport.md), and a
    /// pod-level process; a path with ':' in it (kind's nested systemd) still parses.
    #[test]
    fn staged_and_pod_level_paths() {
        assert_eq!(
            fixture("v2-vm-staged"),
            CgroupOwner::Pod(PodCgroup {
                pod_uid: "1111aaaa-2222".into(),
                qos: Some("besteffort".into()),
                container_id: Some("abc".into()),
                runtime: Some(Runtime::Containerd),
            })
        );
        let pod_level = format!("0::/kubepods/pod{UID}\n");
        assert_eq!(parse_proc_cgroup(&pod_level), pod(None, None, None));
        let nested = format!(
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/\
             kubelet-kubepods-besteffort-pod{}.slice/cri-containerd-{CID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(
            parse_proc_cgroup(&nested),
            pod(Some("besteffort"), Some(CID), Some(Runtime::Containerd))
        );
    }
}
