//! Real RDMA end to end: boots a Debian kernel under qemu (tests/vm/), creates a Soft-RoCE
//! device `rxe0` over the guest's eth0 and runs this build's `fabricgate` against it. One boot
//! runs every scenario (tests/vm/scenarios.sh); each test below asserts one of them.
//!
//! Outside CI the tests skip, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The results of the one boot: the output folder, or why the suite is skipped.
enum Boot {
    Ran(PathBuf),
    Skipped(String),
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn boot() -> &'static Boot {
    static BOOT: OnceLock<Boot> = OnceLock::new();
    BOOT.get_or_init(|| {
        let vm = manifest_dir().join("tests/vm");
        let missing = if Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
        {
            Some("qemu-system-x86_64 is not installed (run .ci/vm.sh)".to_owned())
        } else {
            // Downloads/unpacks the kernel and builds the initramfs once (cached).
            match Command::new("bash").arg(vm.join("setup.sh")).output() {
                Ok(o) if o.status.success() => None,
                Ok(o) => Some(format!(
                    "tests/vm/setup.sh failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => Some(format!("cannot run tests/vm/setup.sh: {e}")),
            }
        };
        if let Some(why) = missing {
            assert!(!in_ci(), "Soft-RoCE VM prerequisites missing in CI: {why}");
            eprintln!("SKIPPED softroce_vm: {why}");
            return Boot::Skipped(why);
        }
        // Kept under target/ (replaced by the next run) so a failure can be inspected:
        // console.log, every command's JSON and stderr are in there.
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("softroce-vm");
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let status = Command::new("bash")
            .arg(vm.join("run.sh"))
            .args(["-t", "290", "-o"])
            .arg(&out)
            .arg(vm.join("scenarios.sh"))
            .current_dir(manifest_dir())
            .env("FG_BIN", env!("CARGO_BIN_EXE_fabricgate"))
            .env("FG_REQ", vm.join("rxe-requirements.yaml"))
            .status()
            .expect("run tests/vm/run.sh");
        assert!(
            status.success(),
            "the VM run failed ({status}); see {}/console.log and stderr",
            out.display()
        );
        Boot::Ran(out)
    })
}

/// The folder of results, or `None` (after printing why) when skipped.
fn results() -> Option<&'static Path> {
    match boot() {
        Boot::Ran(dir) => Some(dir),
        Boot::Skipped(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

fn json(dir: &Path, name: &str) -> Value {
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

fn rc(dir: &Path, name: &str) -> i32 {
    let path = dir.join(format!("{name}.rc"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

fn timings(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(dir.join("timings.env"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim().parse().unwrap()))
        .collect()
}

fn reasons(doc: &Value) -> Vec<String> {
    doc["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect()
}

fn rxe0(doc: &Value) -> &Value {
    doc["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "rxe0")
        .unwrap_or_else(|| panic!("no rxe0 in {doc}"))
}

#[test]
fn rxe0_up_is_ready_with_verbs_opened_for_real() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "up");
    assert_eq!(rc(dir, "up"), 0, "{doc}");
    assert_eq!(doc["ready"], true, "{doc}");
    assert_eq!(doc["rdma"]["ready"], true);
    assert_eq!(doc["rdma"]["usable_ports"], 1);
    assert_eq!(doc["rdma"]["verbs"]["error"], Value::Null);
    assert!(
        doc["rdma"]["verbs"]["devices"]
            .as_array()
            .unwrap()
            .contains(&Value::from("rxe0"))
    );
    let dev = rxe0(&doc);
    assert_eq!(dev["verbs"]["opened"], true, "{dev}");
    assert_eq!(dev["verbs"]["phys_port_cnt"], 1);
    assert!(dev["errors"].as_array().unwrap().is_empty(), "{dev}");
    let port = &dev["ports"][0];
    assert_eq!(port["port"], 1);
    assert_eq!(port["state"], "ACTIVE");
    assert_eq!(port["phys_state"], "LinkUp");
    assert_eq!(port["link_layer"], "Ethernet");
    assert_eq!(port["verbs"]["state"], "ACTIVE", "{port}");
    assert_eq!(port["netdevs"], serde_json::json!(["eth0"]));
    assert!(
        port["gids"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["gid_type"] == "RoCE v2" && g["netdev"] == "eth0"),
        "{port}"
    );
    assert_eq!(doc["labels"]["fabricgate.io/rdma.link-layer"], "Ethernet");
    assert_eq!(doc["labels"]["fabricgate.io/rdma.rate-gbps"], "2.5");
    assert!(doc["taints"].as_array().unwrap().is_empty());
    // rdma.selftest: on-start ran the data path in the same probe.
    assert_eq!(port["selftest"]["ok"], true, "{port}");
    assert!(port["selftest"]["latency_us"].as_f64().unwrap() > 0.0);
}

#[test]
fn selftest_moves_and_verifies_bytes_over_rc_loopback() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "selftest");
    assert_eq!(rc(dir, "selftest"), 0, "{doc}");
    assert_eq!(doc["ok"], true);
    let port = &doc["ports"][0];
    assert_eq!(port["device"], "rxe0");
    assert_eq!(port["port"], 1);
    assert_eq!(port["ok"], true);
    assert_eq!(port["failed_step"], Value::Null);
    let latency = port["latency_us"].as_f64().unwrap();
    assert!(latency > 0.0 && latency < 2_000_000.0, "{latency}");
    // rxe0's GID table: the IPv4-mapped RoCE v2 GID of 10.0.2.15 is index 1.
    assert_eq!(port["gid_index"], 1);
    eprintln!("self-test RDMA WRITE round trip under TCG: {latency:.1} µs");
}

#[test]
fn selftest_names_reg_mr_and_errno_when_memlock_is_too_low() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "selftest_memlock");
    assert_eq!(rc(dir, "selftest_memlock"), 1, "{doc}");
    let port = &doc["ports"][0];
    assert_eq!(port["ok"], false);
    assert_eq!(port["failed_step"], "reg_mr");
    assert_eq!(port["errno"], 12);
    let msg = port["message"].as_str().unwrap();
    assert!(
        msg.starts_with("reg_mr: errno 12 (ENOMEM): RLIMIT_MEMLOCK too low"),
        "{msg}"
    );
    // The same failure through `check`: the port is not ready, the reason says why.
    let check = json(dir, "check_memlock");
    assert_eq!(rc(dir, "check_memlock"), 1);
    assert_eq!(check["ready"], false);
    assert!(
        reasons(&check)
            .iter()
            .any(|r| r
                .starts_with("rxe0 port 1: data-path self-test failed: reg_mr: errno 12 (ENOMEM)")),
        "{:?}",
        reasons(&check)
    );
    assert_eq!(check["conditions"][1]["reason"], "SelftestFailed");
}

#[test]
fn eth0_down_flips_the_verdict_naming_the_port_and_up_restores_it() {
    let Some(dir) = results() else { return };
    let down = json(dir, "down");
    assert_eq!(rc(dir, "down"), 1);
    assert_eq!(down["ready"], false);
    let r = reasons(&down);
    assert!(
        r.iter().any(|m| m.starts_with("rxe0 port 1: state DOWN")),
        "{r:?}"
    );
    assert_eq!(down["conditions"][1]["reason"], "PortDown");
    assert_eq!(down["taints"][0]["key"], "fabricgate.io/unvalidated");
    let t = timings(dir);
    // The very first probe after `ip link set eth0 down` already sees it.
    assert_eq!(t["down_checks"], 1, "{t:?}");

    // `fabricgate selftest` on the down port fails at the first step, saying so.
    let st = json(dir, "selftest_down");
    assert_eq!(rc(dir, "selftest_down"), 1, "{st}");
    assert_eq!(st["ports"][0]["failed_step"], "query_port");
    let msg = st["ports"][0]["message"].as_str().unwrap();
    assert!(msg.contains("port is DOWN"), "{msg}");

    let up = json(dir, "up_again");
    assert_eq!(rc(dir, "up_again"), 0, "{up}");
    assert_eq!(up["ready"], true);
    assert_eq!(rxe0(&up)["ports"][0]["selftest"]["ok"], true);
    eprintln!(
        "eth0 down -> sysfs DOWN {} ms, -> verdict not ready {} ms (one check takes {} ms \
         under TCG); eth0 up -> ACTIVE {} ms, -> ready {} ms",
        t["down_to_sysfs_ms"],
        t["down_to_not_ready_ms"],
        t["check_ms"],
        t["up_to_active_ms"],
        t["up_to_ready_ms"]
    );
}

#[test]
fn hidden_dev_infiniband_is_not_ready_because_verbs_cannot_open_what_sysfs_shows() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "hidden");
    assert_eq!(rc(dir, "hidden"), 1);
    assert_eq!(doc["ready"], false);
    let dev = rxe0(&doc);
    assert_eq!(dev["verbs"]["opened"], false);
    // sysfs still shows the port up...
    assert_eq!(dev["ports"][0]["state"], "ACTIVE");
    // ...and the reason says verbs cannot open it.
    let r = reasons(&doc);
    assert!(
        r.iter().any(
            |m| m.starts_with("rxe0: sysfs shows the device but verbs cannot open it")
                && m.contains("/dev/infiniband")
        ),
        "{r:?}"
    );
    assert_eq!(doc["conditions"][1]["reason"], "VerbsUnavailable");
}

#[test]
fn rdma_link_delete_mid_run_is_reported_not_a_crash() {
    let Some(dir) = results() else { return };
    let rcs = std::fs::read_to_string(dir.join("vanish.rcs")).unwrap();
    let rcs: Vec<i32> = rcs.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(rcs.len(), 6, "{rcs:?}");
    // 0 or 1 only: no panic (101), no signal, no "could not probe".
    assert!(rcs.iter().all(|&c| c == 0 || c == 1), "{rcs:?}");
    let stderr = std::fs::read_to_string(dir.join("vanish.stderr")).unwrap_or_default();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let gone = json(dir, "gone");
    assert_eq!(rc(dir, "gone"), 1);
    assert_eq!(gone["ready"], false);
    assert!(
        reasons(&gone)
            .iter()
            .any(|m| m.starts_with("no RDMA devices")),
        "{:?}",
        reasons(&gone)
    );
}
