//! What the host shows beside the hardware, read on the probe thread after each probe: the
//! kubelet's device-plugin sockets, the RDMA device nodes a device plugin put into this
//! container, and required mounts whose top-level directory this container lacks (then a
//! "missing" mount is the container's blindness, not the node's). Facts only; what they mean
//! for the node is the agent's policy.

use crate::pod::{self, DeviceNode};
use crate::rdma::RdmaReport;
use crate::roots::Roots;
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};

/// Which host checks run.
#[derive(Debug, Clone, Default)]
pub struct HostConfig {
    /// The kubelet's device-plugins directory, as mounted into this container.
    pub device_plugin_dir: PathBuf,
    /// Sockets that must be registered in `device_plugin_dir`.
    pub device_plugin_sockets: Vec<String>,
    /// Compare the selected RDMA devices with their `uverbsN` nodes in this container (set when
    /// the agent gets its devices from a device plugin, as training pods do).
    pub device_nodes: bool,
    /// Look for required mounts whose top-level directory this container lacks. Only
    /// meaningful against the live `/proc` (the mount table then describes this very file
    /// system), so it runs only when the procfs root is `/proc`.
    pub own_mounts: bool,
    /// The kubelet's plugin registration directory (`plugins_registry`), as mounted here.
    pub dra_registry_dir: PathBuf,
    /// DRA drivers whose registration socket must be there and accept a connection.
    pub dra_drivers: Vec<String>,
}

/// What [`check`] saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostReport {
    /// `device_plugin_dir` is not a directory in this container (it was not mounted).
    pub plugin_dir_missing: bool,
    /// Sockets that are not registered, with what is there instead.
    pub socket_problems: Vec<SocketProblem>,
    /// Some selected devices' nodes are missing while others are present: the device nodes
    /// missing, as `path (device)`. Empty when all or none are present.
    pub missing_device_nodes: Vec<String>,
    /// Required mounts reported missing whose top-level directory does not exist here.
    pub own_mounts_missing: Vec<OwnMountMissing>,
    /// `dra_registry_dir` is not a directory in this container (it was not mounted).
    pub dra_registry_missing: bool,
    /// DRA drivers whose kubelet plugin is not registered: `name` is the driver, `problem`
    /// says what is there instead.
    pub dra_problems: Vec<SocketProblem>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketProblem {
    pub name: String,
    /// `<path> does not exist`, `<path> is not a socket`, `cannot inspect <path>: <error>`.
    pub problem: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnMountMissing {
    /// The required mount point.
    pub path: String,
    /// Its top-level directory, absent in this container.
    pub top: PathBuf,
}

/// Run the configured checks. May block on a hung mount (it stats a mount's parent), so it
/// runs on the probe thread.
/// `required_missing`: the required mounts the storage probe did not find in the mount table.
pub fn check(
    config: &HostConfig,
    roots: &Roots,
    rdma: &RdmaReport,
    required_missing: &[String],
) -> HostReport {
    let mut out = HostReport::default();
    if !config.device_plugin_sockets.is_empty() {
        check_sockets(config, &mut out);
    }
    if !config.dra_drivers.is_empty() {
        check_dra_registration(config, &mut out);
    }
    if config.device_nodes {
        out.missing_device_nodes = missing_device_nodes(roots, rdma);
    }
    if config.own_mounts && roots.procfs_root() == Path::new("/proc") {
        out.own_mounts_missing = own_mounts_missing(required_missing);
    }
    out
}

fn check_sockets(config: &HostConfig, out: &mut HostReport) {
    let dir = &config.device_plugin_dir;
    if !dir.is_dir() {
        out.plugin_dir_missing = true;
        return;
    }
    for name in &config.device_plugin_sockets {
        let path = dir.join(name);
        let problem = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => continue,
            Ok(_) => format!("{} is not a socket", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                format!("{} does not exist", path.display())
            }
            Err(e) => format!("cannot inspect {}: {e}", path.display()),
        };
        out.socket_problems.push(SocketProblem {
            name: name.clone(),
            problem,
        });
    }
}

/// Each DRA driver's kubelet plugin registers through `<driver>-reg.sock` (or
/// `<driver>-<pod uid>-reg.sock` during a rolling update) in the kubelet's `plugins_registry`.
/// A plugin killed without cleanup leaves its socket file behind, so the file alone proves
/// nothing: one of them must accept a connection (closed at once, before any gRPC).
fn check_dra_registration(config: &HostConfig, out: &mut HostReport) {
    let dir = &config.dra_registry_dir;
    let names = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect::<Vec<_>>(),
        Err(_) => {
            out.dra_registry_missing = true;
            return;
        }
    };
    for driver in &config.dra_drivers {
        let candidates = registration_sockets(&names, driver);
        if candidates.is_empty() {
            out.dra_problems.push(SocketProblem {
                name: driver.clone(),
                problem: format!(
                    "{} does not exist",
                    dir.join(format!("{driver}-reg.sock")).display()
                ),
            });
            continue;
        }
        let mut why = Vec::new();
        let mut answered = false;
        for name in candidates {
            match accepts(&dir.join(name)) {
                Ok(()) => {
                    answered = true;
                    break;
                }
                Err(e) => why.push(e),
            }
        }
        if !answered {
            out.dra_problems.push(SocketProblem {
                name: driver.clone(),
                problem: why.join("; "),
            });
        }
    }
}

/// Of the file names `names` (a `plugins_registry` listing), the driver's registration
/// sockets: `<driver>-reg.sock` first, then any `<driver>-<uid>-reg.sock` in name order.
pub fn registration_sockets<'a>(names: &'a [String], driver: &str) -> Vec<&'a str> {
    let mut found: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| is_registration_socket(n, driver))
        .collect();
    found.sort_by_key(|n| (n.len(), *n));
    found
}

/// `<driver>-reg.sock`, or `<driver>-<uid>-reg.sock` with a pod UID (36 characters).
fn is_registration_socket(name: &str, driver: &str) -> bool {
    name.strip_prefix(driver)
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|rest| {
            rest.strip_suffix("-reg.sock")
                .or_else(|| (rest == "reg.sock").then_some(""))
        })
        .is_some_and(|uid| {
            uid.is_empty()
                || (uid.len() == 36 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'))
        })
}

/// Whether a unix stream socket at `path` accepts a connection, without blocking (a full
/// backlog counts as alive: someone listens).
fn accepts(path: &Path) -> Result<(), String> {
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {}
        Ok(_) => return Err(format!("{shown} is not a socket")),
        Err(e) => return Err(format!("cannot inspect {shown}: {e}")),
    }
    let addr = SocketAddrUnix::new(path)
        .map_err(|e| format!("cannot connect to {shown}: {e} (path too long?)"))?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| format!("cannot make a socket to check {shown}: {e}"))?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) | Err(Errno::AGAIN) | Err(Errno::INPROGRESS) => Ok(()),
        Err(Errno::CONNREFUSED) => Err(format!(
            "{shown} refuses connections: nothing listens on it (the plugin is gone)"
        )),
        Err(e) => Err(format!("cannot connect to {shown}: {e}")),
    }
}

/// A plugin that started before the driver hands out an incomplete set: some selected devices'
/// nodes are in the container, others not. None at all is how the agent was deployed, not the
/// plugin, and is left to the verbs probe.
fn missing_device_nodes(roots: &Roots, rdma: &RdmaReport) -> Vec<String> {
    let Ok(nodes) = pod::device_nodes(roots) else {
        return Vec::new(); // unreadable class/infiniband_verbs: the RDMA probe reports it
    };
    let selected: Vec<&DeviceNode> = nodes
        .iter()
        .filter(|n| rdma.devices.iter().any(|d| d.name == n.device))
        .collect();
    let missing: Vec<String> = selected
        .iter()
        .filter(|n| !n.present)
        .map(|n| format!("{} ({})", n.path.display(), n.device))
        .collect();
    if missing.len() == selected.len() {
        return Vec::new();
    }
    missing
}

/// Of the required mounts missing from the mount table, those whose top-level directory does
/// not exist in this container either: the agent's deployment lacks them.
fn own_mounts_missing(required_missing: &[String]) -> Vec<OwnMountMissing> {
    required_missing
        .iter()
        .filter_map(|path| {
            let top = top_level(Path::new(path))?;
            match std::fs::symlink_metadata(&top) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(OwnMountMissing {
                    path: path.clone(),
                    top,
                }),
                _ => None,
            }
        })
        .collect()
}

/// `/lustre` of `/lustre/scratch`; `None` for `/` itself.
fn top_level(path: &Path) -> Option<PathBuf> {
    let mut comps = path.components();
    match (comps.next(), comps.next()) {
        (Some(Component::RootDir), Some(Component::Normal(first))) => {
            Some(Path::new("/").join(first))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::DeviceReport;

    fn rdma_of(names: &[&str]) -> RdmaReport {
        RdmaReport {
            devices: names
                .iter()
                .map(|n| DeviceReport {
                    name: (*n).to_owned(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn sockets(dir: &Path, names: &[&str]) -> HostConfig {
        HostConfig {
            device_plugin_dir: dir.to_path_buf(),
            device_plugin_sockets: names.iter().map(|s| (*s).to_owned()).collect(),
            ..HostConfig::default()
        }
    }

    #[test]
    fn a_plugin_socket_must_be_a_registered_socket() {
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots::new(dir.path(), dir.path());
        let config = sockets(dir.path(), &["rdma.sock"]);
        let sock = dir.path().join("rdma.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert_eq!(
            check(&config, &roots, &rdma_of(&[]), &[]),
            HostReport::default()
        );
        drop(listener);
        std::fs::remove_file(&sock).unwrap();
        let found = check(&config, &roots, &rdma_of(&[]), &[]);
        assert_eq!(
            found.socket_problems,
            vec![SocketProblem {
                name: "rdma.sock".into(),
                problem: format!("{} does not exist", sock.display()),
            }]
        );
        std::fs::write(&sock, "").unwrap();
        let found = check(&config, &roots, &rdma_of(&[]), &[]);
        assert!(
            found.socket_problems[0]
                .problem
                .ends_with("is not a socket")
        );
        let absent = sockets(&dir.path().join("absent"), &["rdma.sock"]);
        let found = check(&absent, &roots, &rdma_of(&[]), &[]);
        assert!(found.plugin_dir_missing && found.socket_problems.is_empty());
    }

    #[test]
    fn a_dra_driver_is_registered_only_while_its_socket_answers() {
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots::new(dir.path(), dir.path());
        let config = HostConfig {
            dra_registry_dir: dir.path().to_path_buf(),
            dra_drivers: vec!["dra.net".into()],
            ..HostConfig::default()
        };
        let found = check(&config, &roots, &rdma_of(&[]), &[]);
        assert_eq!(found.dra_problems.len(), 1);
        assert!(
            found.dra_problems[0]
                .problem
                .ends_with("dra.net-reg.sock does not exist")
        );

        // A rolling update's socket name counts; another driver's does not.
        let uid = "0b6c4a3e-1f2d-4c5b-8a9e-0123456789ab";
        let other = dir.path().join("dra.net.example-reg.sock");
        let _other = std::os::unix::net::UnixListener::bind(&other).unwrap();
        let sock = dir.path().join(format!("dra.net-{uid}-reg.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let found = check(&config, &roots, &rdma_of(&[]), &[]);
        assert!(found.dra_problems.is_empty(), "{:?}", found.dra_problems);

        // Killed without cleanup: the file stays, nobody listens.
        drop(listener);
        assert!(sock.exists());
        let found = check(&config, &roots, &rdma_of(&[]), &[]);
        assert_eq!(found.dra_problems.len(), 1);
        assert!(
            found.dra_problems[0]
                .problem
                .contains("refuses connections"),
            "{:?}",
            found.dra_problems
        );

        let absent = HostConfig {
            dra_registry_dir: dir.path().join("absent"),
            ..config
        };
        let found = check(&absent, &roots, &rdma_of(&[]), &[]);
        assert!(found.dra_registry_missing && found.dra_problems.is_empty());
    }

    #[test]
    fn registration_socket_names() {
        assert!(is_registration_socket("dra.net-reg.sock", "dra.net"));
        assert!(is_registration_socket(
            "dra.net-0b6c4a3e-1f2d-4c5b-8a9e-0123456789ab-reg.sock",
            "dra.net"
        ));
        assert!(!is_registration_socket("dra.net.x-reg.sock", "dra.net"));
        assert!(!is_registration_socket("dra.net-other-reg.sock", "dra.net"));
        assert!(!is_registration_socket("dra.net.sock", "dra.net"));
    }

    #[test]
    fn only_an_incomplete_set_of_selected_device_nodes_is_reported() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/pod-4of8");
        let roots = Roots::new(fixture.join("sys"), fixture.join("proc"));
        let config = HostConfig {
            device_nodes: true,
            ..HostConfig::default()
        };
        let with_dev = roots.clone().with_devfs(fixture.join("dev"));
        // uverbs0-3 are in the fixture's /dev, uverbs4-9 are not.
        let found = check(
            &config,
            &with_dev,
            &rdma_of(&["mlx5_0", "mlx5_1", "mlx5_4"]),
            &[],
        );
        assert_eq!(found.missing_device_nodes.len(), 1);
        assert!(
            found.missing_device_nodes[0].ends_with("infiniband/uverbs4 (mlx5_4)"),
            "{found:?}"
        );
        let all_there = check(&config, &with_dev, &rdma_of(&["mlx5_0", "mlx5_3"]), &[]);
        assert_eq!(all_there, HostReport::default());
        let no_dev = roots.clone().with_devfs(fixture.join("no-dev"));
        let nothing = check(&config, &no_dev, &rdma_of(&["mlx5_0", "mlx5_4"]), &[]);
        assert_eq!(nothing, HostReport::default());
        let off = check(
            &HostConfig::default(),
            &with_dev,
            &rdma_of(&["mlx5_0", "mlx5_4"]),
            &[],
        );
        assert_eq!(off, HostReport::default());
    }

    #[test]
    fn a_required_mount_is_the_agents_to_lack_only_when_its_top_directory_is_absent() {
        let absent = "/fabricgate-absent-top-level/scratch".to_owned();
        let missing = own_mounts_missing(&[absent.clone(), "/tmp/not-mounted".into()]);
        assert_eq!(
            missing,
            [OwnMountMissing {
                path: absent,
                top: PathBuf::from("/fabricgate-absent-top-level"),
            }],
            "/tmp exists in the container: only the mount itself is missing, the node's fault"
        );
        assert!(own_mounts_missing(&[]).is_empty());
    }

    #[test]
    fn top_level_directory_of_a_mount() {
        assert_eq!(
            top_level(Path::new("/lustre/scratch")),
            Some(PathBuf::from("/lustre"))
        );
        assert_eq!(top_level(Path::new("/")), None);
        assert_eq!(top_level(Path::new("relative/x")), None);
    }
}
