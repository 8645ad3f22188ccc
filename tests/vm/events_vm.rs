//! Event-driven detection on a real RDMA device: the Soft-RoCE VM (tests/vm/) runs the agent
//! with `--interval 30s --dry-run` and flips rxe0's netdev down and up (tests/vm/
//! events-scenarios.sh). Each `ip link set eth0 down` must reach the dry-run log of the taint
//! within one second; the latencies are printed (docs/events.md). One boot runs the scenario.
//!
//! Outside CI the tests skip, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

const FLIPS: usize = 10;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn boot() -> &'static Result<PathBuf, String> {
    static BOOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        let req = manifest_dir().join("tests/vm/rxe-requirements.yaml");
        let flips = FLIPS.to_string();
        common::run_vm_once(
            "run.sh",
            300,
            "events-vm",
            "events-scenarios.sh",
            &[
                ("FG_REQ", req.as_os_str()),
                ("FG_FLIPS", OsStr::new(&flips)),
            ],
            "console.log, stderr and daemon.log",
        )
    })
}

fn results() -> Option<&'static Path> {
    common::vm_results(boot())
}

/// The `{name}_{i}` values for i in 1..=FLIPS that are present.
fn series(t: &BTreeMap<String, u64>, name: &str) -> Vec<Duration> {
    (1..=FLIPS)
        .filter_map(|i| t.get(&format!("{name}_{i}")))
        .map(|&us| Duration::from_micros(us))
        .collect()
}

fn median_max(v: &[Duration]) -> (Duration, Duration) {
    let mut s = v.to_vec();
    s.sort();
    (s[s.len() / 2], s[s.len() - 1])
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default()
}

/// [`common::sample`]; a missing series fails the test.
fn value_of(metrics: &str, series: &str) -> f64 {
    common::sample(metrics, series).unwrap_or_else(|| panic!("no {series} in:\n{metrics}"))
}

#[test]
fn eth0_down_reaches_the_taint_within_a_second_with_a_30s_interval() {
    let Some(dir) = results() else { return };
    let t = common::vm_timings(dir);
    let down = series(&t, "down_to_taint_us");
    assert_eq!(down.len(), FLIPS, "{t:?}\n{}", log(dir));
    let (median, max) = median_max(&down);
    eprintln!(
        "eth0 down -> dry-run taint, --interval 30s, {FLIPS} flips under TCG: median {} ms, \
         max {} ms; all: {:?} ms",
        median.as_millis(),
        max.as_millis(),
        down.iter().map(Duration::as_millis).collect::<Vec<_>>()
    );
    for (i, d) in down.iter().enumerate() {
        assert!(
            *d <= Duration::from_secs(1),
            "flip {}: {d:?} from eth0 down to the taint decision",
            i + 1
        );
    }
    // The target for the agent's part, "port down -> verdict not ready <= 300 ms
    // whatever --interval is", on the median (single flips can stall behind the host).
    assert!(median <= Duration::from_millis(300), "{down:?}");
    let up = series(&t, "up_to_untaint_us");
    assert_eq!(up.len(), FLIPS, "{t:?}");
    let (median, max) = median_max(&up);
    eprintln!(
        "eth0 up -> dry-run untaint (recover_after 1): median {} ms, max {} ms",
        median.as_millis(),
        max.as_millis()
    );
    assert!(max < Duration::from_secs(5), "{up:?}");
    let netlink = series(&t, "down_to_netlink_us");
    assert_eq!(
        netlink.len(),
        FLIPS,
        "every flip is announced over rtnetlink: {t:?}"
    );
    // Where the time goes, median and max of each step from the ioctl.
    for (what, name) in [
        ("the SIOCSIFFLAGS ioctl itself", "down_ioctl_us"),
        (
            "rtnetlink event logged by the event thread",
            "down_to_netlink_us",
        ),
        ("IBV_EVENT_PORT_ERR logged", "down_to_port_err_us"),
        (
            "event-triggered probe starts (after the 30 ms debounce)",
            "down_to_probe_us",
        ),
        (
            "verdict not ready (fail-fast port state read)",
            "down_to_verdict_us",
        ),
        (
            "dry-run taint logged by the Node writer",
            "down_to_taint_us",
        ),
    ] {
        let v = series(&t, name);
        if v.is_empty() {
            eprintln!("  {what}: not measured");
            continue;
        }
        let (median, max) = median_max(&v);
        eprintln!(
            "  eth0 down -> {what}: median {:.1} ms, max {:.1} ms",
            median.as_secs_f64() * 1e3,
            max.as_secs_f64() * 1e3
        );
    }
}

#[test]
fn the_probes_were_triggered_by_events_not_the_interval() {
    let Some(dir) = results() else { return };
    let metrics = std::fs::read_to_string(dir.join("metrics.txt")).unwrap();
    let by = |trigger: &str| {
        value_of(
            &metrics,
            &format!("fabricgate_probe_trigger_total{{trigger=\"{trigger}\"}}"),
        )
    };
    // The scenario lasts well under 30 s per interval tick: a handful of interval probes,
    // at least two event-triggered probes per flip.
    let events = by("netlink") + by("uevent") + by("verbs_async");
    assert!(
        events >= (2 * FLIPS) as f64,
        "event-triggered probes: {events}\n{metrics}"
    );
    assert!(by("interval") < events, "{metrics}");
    for source in ["netlink", "uevent", "verbs_async"] {
        assert!(
            value_of(
                &metrics,
                &format!("fabricgate_events_total{{source=\"{source}\"}}")
            ) > 0.0,
            "no {source} event received\n{metrics}"
        );
    }
    for source in ["netlink", "uevent"] {
        assert_eq!(
            value_of(
                &metrics,
                &format!("fabricgate_event_source_active{{source=\"{source}\"}}")
            ),
            1.0,
            "{metrics}"
        );
    }
    eprintln!(
        "probe triggers: interval {}, netlink {}, uevent {}, verbs_async {}",
        by("interval"),
        by("netlink"),
        by("uevent"),
        by("verbs_async")
    );
}

#[test]
fn rxe_delivers_port_err_and_port_active_verbs_events() {
    let Some(dir) = results() else { return };
    let log = log(dir);
    let t = common::vm_timings(dir);
    let err = series(&t, "down_to_port_err_us");
    let active = series(&t, "up_to_port_active_us");
    assert!(log.contains("rxe0 port 1 IBV_EVENT_PORT_ERR"), "{log}");
    assert!(log.contains("rxe0 port 1 IBV_EVENT_PORT_ACTIVE"), "{log}");
    assert_eq!(err.len(), FLIPS, "{t:?}");
    let (median, max) = median_max(&err);
    eprintln!(
        "eth0 down -> IBV_EVENT_PORT_ERR logged: median {} ms, max {} ms ({} of {FLIPS} flips); \
         eth0 up -> IBV_EVENT_PORT_ACTIVE in {} of {FLIPS}",
        median.as_millis(),
        max.as_millis(),
        err.len(),
        active.len()
    );
}

#[test]
fn the_held_verbs_context_does_not_hold_up_rdma_link_delete() {
    let Some(dir) = results() else { return };
    let t = common::vm_timings(dir);
    let rc = std::fs::read_to_string(dir.join("delete.rc")).unwrap();
    assert_eq!(rc.trim(), "0", "rdma link delete failed or timed out");
    assert!(t["delete_ms"] < 5_000, "{t:?}");
    assert!(t.contains_key("delete_to_taint_us"), "{t:?}\n{}", log(dir));
    assert!(t.contains_key("add_to_untaint_us"), "{t:?}\n{}", log(dir));
    assert!(
        dir.join("verbs.relistened").exists(),
        "the verbs source did not re-open rxe0:\n{}",
        log(dir)
    );
    let rc = std::fs::read_to_string(dir.join("daemon.rc")).unwrap();
    assert_eq!(rc.trim(), "0", "daemon exit after SIGTERM:\n{}", log(dir));
    let log = log(dir);
    assert!(!log.contains("panicked"), "{log}");
    eprintln!(
        "rdma link delete with the agent's context open: {} ms; -> taint {} ms; \
         rdma link add -> untaint {} ms",
        t["delete_ms"],
        t["delete_to_taint_us"] / 1000,
        t["add_to_untaint_us"] / 1000
    );
}
