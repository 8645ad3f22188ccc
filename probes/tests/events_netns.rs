//! The event sources on the real kernel: in a private network namespace (`unshare -n`, so
//! nothing on the host changes) a veth pair is created, set up, set down and deleted, and
//! `EventSources` must report the rtnetlink link changes and the `net` uevents of it.
//!
//! The test re-runs itself inside the namespace (`FG_EVENTS_IN_NETNS=1`). Needs root,
//! util-linux `unshare` and iproute2 `ip` with veth: elsewhere it prints `SKIP:` and returns;
//! under `CI=true` their absence fails it.

use fabricgate_probes::events::{Event, EventOptions, EventSources, Source};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const INNER: &str = "FG_EVENTS_IN_NETNS";
const TEST: &str = "link_changes_and_uevents_of_a_veth_pair_in_a_private_network_namespace";

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

fn ip(args: &str) {
    let status = Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .unwrap_or_else(|e| panic!("ip {args}: {e}"));
    assert!(status.success(), "ip {args}: {status}");
}

#[test]
fn link_changes_and_uevents_of_a_veth_pair_in_a_private_network_namespace() {
    if std::env::var_os(INNER).is_none() {
        let usable = Command::new("unshare")
            .args([
                "-n", "ip", "link", "add", "fgv0", "type", "veth", "peer", "name", "fgv1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !usable {
            assert!(
                !in_ci(),
                "CI=true: `unshare -n` and `ip link add ... type veth` must work here \
                 (root, util-linux, iproute2, the veth module)"
            );
            println!(
                "SKIP: {TEST}: `unshare -n ip link add ... type veth` is not permitted here \
                 (needs root, util-linux, iproute2 and veth)"
            );
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = Command::new("unshare")
            .arg("-n")
            .arg(&exe)
            .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
            .env(INNER, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "inside the namespace:\n{text}");
        assert!(
            text.contains("1 passed"),
            "the inner test did not run:\n{text}"
        );
        return;
    }

    // Inside the private network namespace.
    let mut sources = EventSources::open(EventOptions {
        netlink: true,
        uevent: true,
        verbs: false,
    });
    let status = sources.status();
    assert!(status[0].active, "{status:?}");
    assert!(status[1].active, "{status:?}");
    assert!(!status[2].active, "{status:?}");

    ip("link add v0 type veth peer name v1");
    ip("link set v0 up");
    ip("link set v1 up");
    ip("link set v1 down");
    ip("link del v0");

    let mut events: Vec<Event> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let seen = |events: &[Event]| {
        let link = |f: &dyn Fn(&fabricgate_probes::events::LinkChange) -> bool| {
            events.iter().any(|e| matches!(e, Event::Link(l) if f(l)))
        };
        let uevent = |action: &str, name: &str| {
            events.iter().any(|e| {
                matches!(e, Event::Uevent(u) if u.action == action && u.subsystem == "net"
                    && u.name == name)
            })
        };
        link(&|l| l.name.as_deref() == Some("v1") && l.up && !l.deleted)
            && link(&|l| l.name.as_deref() == Some("v1") && !l.up && !l.deleted)
            && link(&|l| l.name.as_deref() == Some("v0") && l.deleted)
            && uevent("add", "v0")
            && uevent("remove", "v0")
            && uevent("add", "v1")
    };
    while !seen(&events) && Instant::now() < deadline {
        events.extend(sources.wait(Duration::from_millis(200)));
    }
    let listed: Vec<String> = events.iter().map(ToString::to_string).collect();
    assert!(seen(&events), "missing events; got:\n{}", listed.join("\n"));
    // Only the subsystems asked for: the veth queues' uevents (subsystem "queues") are not
    // reported, and every event names its source.
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, Event::Uevent(u) if u.subsystem == "queues")),
        "{listed:?}"
    );
    assert!(
        events
            .iter()
            .all(|e| matches!(e.source(), Source::Netlink | Source::Uevent)),
        "{listed:?}"
    );
    println!("{} events:\n{}", events.len(), listed.join("\n"));
}
