//! The one test-support module of every integration test binary (`mod common;`). Here: what a
//! test asks about its environment ("in CI?", "root?", where the fixtures are, where a tool
//! is) and the Soft-RoCE VM runner. In submodules: running the binary (`cli`), fixture trees
//! (`fixture`, `sysfs`), metrics and HTTP (`metrics`), waits with a deadline (`wait`),
//! `fabricgate run` as a child process (`agent`), the real control plane and its Nodes
//! (`controlplane`, `faultproxy`, `tls`, `node`), Kueue and kube-controller-manager beside it
//! (`kueue`) and storage scratch mounts (`storage`).
//!
//! The rule it enforces: a test that lacks a tool or a privilege it needs FAILS under CI
//! (`CI=true`, or `CI=1`), and elsewhere prints one `SKIP: <test>: <what is missing> (<how to
//! get it>)` line and returns. Nothing else in `tests/` decides to skip.
//!
//! ```ignore
//! mod common;
//! let Some(promtool) = common::require_tool("promtool", ".ci/metrics.sh installs it") else {
//!     return;
//! };
//! if !common::require_root("mount(2) needs root") { return; }
//! ```

#![allow(dead_code)] // every test binary uses a different subset

pub mod agent;
pub mod cli;
pub mod controlplane;
pub mod faultproxy;
pub mod fixture;
pub mod fleet;
pub mod guard;
pub mod guard_scale;
pub mod kueue;
pub mod kueue_crds;
pub mod metrics;
pub mod node;
pub mod procstat;
pub mod scale;
pub mod scale_transport;
pub mod storage;
pub mod sysfs;
pub mod tls;
pub mod wait;

#[allow(unused_imports)]
pub use agent::*;
#[allow(unused_imports)]
pub use cli::*;
#[allow(unused_imports)]
pub use metrics::*;
#[allow(unused_imports)]
pub use node::*;
#[allow(unused_imports)]
pub use wait::*;

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// True under CI, where a missing prerequisite must fail the test instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Whether this process runs with effective UID 0 (from `/proc/self/status`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// The gang pre-flight's two CRDs (FabricCheck, FabricCheckResult) exactly as
/// `deploy/admission-check.yaml` ships them (its `CustomResourceDefinition` documents, as one
/// multi-document YAML), so every test serves the shipped schemas.
pub fn fabriccheck_crds() -> String {
    let path = repo_root().join("deploy/admission-check.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let docs: Vec<&str> = text
        .split("\n---")
        .filter(|doc| doc.contains("\nkind: CustomResourceDefinition"))
        .map(|doc| doc.trim_start_matches('\n'))
        .collect();
    assert_eq!(docs.len(), 2, "two CRDs in {}", path.display());
    docs.join("\n---\n")
}

/// The names of [`fabriccheck_crds`], to wait for them to be established.
pub const FABRICCHECK_CRDS: [&str; 2] = [
    "fabricchecks.fabricgate.io",
    "fabriccheckresults.fabricgate.io",
];

/// A FabricCheckResult as a member's agent creates it (docs/gangs.md): `result` (the
/// measurement, camelCase, with its `node`) answering FabricCheck `check` of uid `uid`.
pub fn fabriccheck_answer(check: &str, uid: &str, result: &serde_json::Value) -> serde_json::Value {
    let node = result["node"].as_str().unwrap_or_default();
    let mut spec = result.clone();
    spec["check"] = check.into();
    spec["checkUID"] = uid.into();
    if spec.get("finishedAt").is_none() {
        spec["finishedAt"] = "2026-12-02T03:00:07Z".into();
    }
    serde_json::json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheckResult",
        "metadata": { "name": format!("{uid}.{node}"), "namespace": "fabricgate",
            "labels": { "fabricgate.io/fabriccheck-uid": uid },
            "ownerReferences": [{ "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
                "name": check, "uid": uid }] },
        "spec": spec,
    })
}

/// The FabricCheckResults (whole objects) labelled with check uid `uid`, in `fabricgate`.
pub fn fabriccheck_answers(cp: &controlplane::ControlPlane, uid: &str) -> Vec<serde_json::Value> {
    cp.get_json(&format!(
        "/apis/fabricgate.io/v1alpha1/namespaces/fabricgate/fabriccheckresults\
         ?labelSelector=fabricgate.io%2Ffabriccheck-uid%3D{uid}"
    ))
    .and_then(|l| l["items"].as_array().cloned())
    .unwrap_or_default()
}

/// The repository root (`CARGO_MANIFEST_DIR` of the agent crate).
/// A TCP connection to `dst` from the local address `src` (a loopback address standing for
/// another host, as the red-team tests' strangers).
pub fn connect_from(
    src: [u8; 4],
    dst: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    bind(&fd, &std::net::SocketAddrV4::new(src.into(), 0))?;
    let std::net::SocketAddr::V4(dst) = dst else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    connect(&fd, &dst)?;
    Ok(std::net::TcpStream::from(fd))
}

/// A size or a number of seconds from the environment variable `name` (the benches'
/// settings), else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A committed fixture (`tests/fixtures/<name>`: a node tree with `sys/` and `proc/`, or a
/// file such as `requirements-ndr.yaml`).
pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// Copy a fixture tree into `to` (made if missing), keeping its symlinks as symlinks.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src).unwrap(), &dst).unwrap();
        } else if kind.is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// `name` on `PATH` (an executable file), without running it.
pub fn tool(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The name libtest gave the current test's thread (the test's path), for `SKIP:` lines.
fn test_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_owned()
}

/// The name libtest knows test `name` of module `module` (its `module_path!()`) by: the path
/// without the crate, as `--exact` wants it to run that one test again in a child process.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_owned(),
    }
}

/// Every `.rs` file under `dir`, sorted.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// A prerequisite the test cannot run without. `Ok` (`true`): go on. Missing: under CI the
/// test fails with `what` and `how`; elsewhere a `SKIP:` line is printed and `false` returned.
pub fn require(ok: bool, what: &str, how: &str) -> bool {
    if ok {
        return true;
    }
    assert!(
        !in_ci(),
        "CI=true and this test's prerequisite is missing: {what} ({how})"
    );
    eprintln!("SKIP: {}: {what} ({how})", test_name());
    false
}

/// [`tool`], as a prerequisite: `how` says how to install it.
pub fn require_tool(name: &str, how: &str) -> Option<PathBuf> {
    let found = tool(name);
    require(found.is_some(), &format!("{name} is not installed"), how).then_some(())?;
    found
}

/// Root, as a prerequisite; `why` says what needs it.
pub fn require_root(why: &str) -> bool {
    require(
        is_root(),
        &format!("not running as root ({why})"),
        "run the tests as root, as CI does",
    )
}

/// Whether this process may make a private mount namespace (`unshare -m`: root and
/// util-linux).
pub fn can_unshare_mounts() -> bool {
    std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// [`can_unshare_mounts`], as a prerequisite.
pub fn require_unshare_mounts() -> bool {
    require(
        can_unshare_mounts(),
        "`unshare -m` is not permitted here",
        "run as root with util-linux installed, as CI does",
    )
}

/// Whether to rewrite golden files instead of comparing with them (`UPDATE_GOLDEN=1`). Under
/// CI this is refused: the test fails, so CI can only compare.
pub fn update_golden() -> bool {
    let asked = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| !v.is_empty() && v != "0");
    assert!(
        !(asked && in_ci()),
        "UPDATE_GOLDEN is refused under CI: golden files are only rewritten on purpose, locally"
    );
    asked
}

/// Kept for the metrics tests: `promtool`/`prometheus` as a prerequisite.
pub fn have_tool(name: &str) -> bool {
    require_tool(
        name,
        "apt-get install prometheus; .ci/metrics.sh installs it",
    )
    .is_some()
}

/// What a finished command printed: its stdout, then its stderr (invalid UTF-8 replaced).
pub fn stdout_and_stderr(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The Kubernetes versions the manifests must validate against: the oldest supported (the
/// admission policy and the node-name token claim need 1.30) and the newest schema published.
pub const KUBERNETES_SCHEMAS: [&str; 2] = ["1.30.0", "1.37.0"];

/// `kubernetes-validate --strict` of `manifest` against both [`KUBERNETES_SCHEMAS`]: it
/// passes, and every one of its `objects` objects was checked.
pub fn assert_valid_for_both_schemas(kv: &Path, manifest: &Path, objects: usize) {
    for version in KUBERNETES_SCHEMAS {
        let out = std::process::Command::new(kv)
            .args(["--strict", "-k", version])
            .arg(manifest)
            .output()
            .expect("run kubernetes-validate");
        let text = stdout_and_stderr(&out);
        assert!(
            out.status.success(),
            "kubernetes-validate {version} {}:\n{text}",
            manifest.display()
        );
        assert_eq!(
            text.matches(" passed for resource ").count(),
            objects,
            "every object of {} checked against {version}:\n{text}",
            manifest.display()
        );
    }
}

/// Why the Soft-RoCE VM cannot run here (no qemu, or `tests/vm/setup.sh` failed), or `None`
/// once its kernel and initramfs are ready (setup downloads and builds them once, cached).
pub fn vm_prerequisites_missing() -> Option<String> {
    if tool("qemu-system-x86_64").is_none() {
        return Some("qemu-system-x86_64 is not installed (run .ci/vm.sh)".to_owned());
    }
    match std::process::Command::new("bash")
        .arg(repo_root().join("tests/vm/setup.sh"))
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "tests/vm/setup.sh failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run tests/vm/setup.sh: {e}")),
    }
}

/// A VM run's output file, whole (the test fails naming the file when it cannot be read).
pub fn vm_read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A VM run's exit-code file (`rc`, `<step>.rc`).
pub fn vm_rc(path: &Path) -> i32 {
    let text = vm_read(path);
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}: {text:?}", path.display()))
}

/// A VM run's JSON output file.
pub fn vm_json(path: &Path) -> serde_json::Value {
    let text = vm_read(path);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

/// Held while a VM runs: one emulated machine at a time in this process, whichever suite
/// boots it (the VM suites share one test binary; their timings assume unshared CPUs).
pub fn vm_slot() -> std::sync::MutexGuard<'static, ()> {
    static SLOT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A suite whose run panicked leaves nothing behind that the next one needs.
    SLOT.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `bash tests/vm/<runner> -t <timeout_s> -o <out> tests/vm/<scenarios>` from the repository
/// root with `FG_BIN` set, and `out`: `<target tmp>/<name>`, emptied now and kept after the run
/// so that a failure can be inspected. The caller adds its own `FG_*` variables.
pub fn vm_command(
    runner: &str,
    timeout_s: u32,
    name: &str,
    scenarios: &str,
) -> (std::process::Command, PathBuf) {
    let vm = repo_root().join("tests/vm");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("create the VM output directory");
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(vm.join(runner))
        .args(["-t", &timeout_s.to_string(), "-o"])
        .arg(&out)
        .arg(vm.join(scenarios))
        .current_dir(repo_root())
        .env("FG_BIN", env!("CARGO_BIN_EXE_fabricgate"));
    (cmd, out)
}

/// One run of `scenarios` in the VM(s) of `runner` ([`vm_command`]), with the caller's `FG_*`
/// variables `env`, to its end: the output folder, or why the VM cannot run here
/// ([`vm_prerequisites_missing`]). A failed run fails the test, naming the files to `inspect`
/// under the output folder.
pub fn run_vm_once(
    runner: &str,
    timeout_s: u32,
    name: &str,
    scenarios: &str,
    env: &[(&str, &std::ffi::OsStr)],
    inspect: &str,
) -> Result<PathBuf, String> {
    if let Some(why) = vm_prerequisites_missing() {
        return Err(why);
    }
    let _slot = vm_slot();
    let boot = || {
        let (mut cmd, out) = vm_command(runner, timeout_s, name, scenarios);
        let status = cmd
            .envs(env.iter().copied())
            .status()
            .unwrap_or_else(|e| panic!("run tests/vm/{runner}: {e}"));
        (status, out)
    };
    let (mut status, out) = boot();
    if let Some(fault) = vm_emulation_fault(&out) {
        keep_first_boot(name, &out, &fault);
        status = boot().0;
        if let Some(again) = vm_emulation_fault(&out) {
            let _ = writeln!(std::io::stderr(), "{name}: again: {again}");
        }
    }
    assert!(
        status.success(),
        "tests/vm/{runner} failed ({status}); see {}/{inspect}",
        out.display()
    );
    Ok(out)
}

/// Before booting VM run `name` once more after the emulated machine's `fault`: its first
/// boot's folder `out` kept as `<name>.first-boot` beside it, and the second boot said on
/// stderr, past libtest's capture (so in a passing run's output too).
pub fn keep_first_boot(name: &str, out: &Path, fault: &str) {
    let first = out.with_file_name(format!("{name}.first-boot"));
    let _ = std::fs::remove_dir_all(&first);
    let kept = match std::fs::rename(out, &first) {
        Ok(()) => format!("its files: {}", first.display()),
        Err(e) => format!("its files could not be kept ({e})"),
    };
    let _ = writeln!(
        std::io::stderr(),
        "{name}: the emulated machine failed, not what ran in it ({fault}); booting it once \
         more ({kept})"
    );
}

/// A fault of the emulated machine itself, not of what runs in it, from the guests' kernel
/// logs in `out` or one folder down (a pair's `a/`, `b/`): the emulated NIC stopped
/// transmitting for good (`NETDEV WATCHDOG`: qemu 7.2's virtio-net over the pair's UDP
/// tunnels, about one pair boot in six under load here; the link under rxe0 is dead from then
/// on), or the guest kernel panicked inside Soft-RoCE (seen after such a stall: rxe's skb
/// destructor on a QP already destroyed, once the stuck skbs were freed).
pub fn vm_emulation_fault(out: &Path) -> Option<String> {
    let dirs = std::iter::once(out.to_owned()).chain(
        std::fs::read_dir(out)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir()),
    );
    for dir in dirs {
        for file in ["dmesg.log", "console.log"].map(|f| dir.join(f)) {
            let Ok(bytes) = std::fs::read(&file) else {
                continue;
            };
            let text = String::from_utf8_lossy(&bytes);
            let at = |line: &str| format!("{}: {}", file.display(), line.trim());
            if let Some(line) = text.lines().find(|l| l.contains("NETDEV WATCHDOG")) {
                return Some(at(line));
            }
            let rxe_oops = text
                .lines()
                .find(|l| l.contains("RIP:") && l.contains("[rdma_rxe]"));
            if let (Some(rip), true) = (rxe_oops, text.contains("Kernel panic")) {
                return Some(at(rip));
            }
        }
    }
    None
}

/// The output folder of a [`run_vm_once`], or `None` after [`require`] said why the VM could
/// not run (a failure under CI).
pub fn vm_results(run: &Result<PathBuf, String>) -> Option<&Path> {
    match run {
        Ok(dir) => Some(dir),
        Err(why) => {
            require(false, why, "run .ci/vm.sh");
            None
        }
    }
}

/// The `NAME=MICROSECONDS` lines a VM scenario wrote to `<dir>/timings.env`.
pub fn vm_timings(dir: &Path) -> std::collections::BTreeMap<String, u64> {
    std::fs::read_to_string(dir.join("timings.env"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim().parse().unwrap()))
        .collect()
}
