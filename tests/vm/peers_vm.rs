//! Inter-node RDMA on real kernels: two Soft-RoCE VMs (tests/vm/run-pair.sh) on one private
//! qemu network, each with rxe0 and an agent measuring the other (tests/vm/peers-scenarios.sh).
//! One boot of the pair runs every scenario; each test below asserts one of them:
//! - both agents export RTT and bandwidth for each other,
//! - `ip link set eth0 down` in one VM turns into peer errors in the other within two rounds,
//!   and the FabricgatePeerUnreachable expression (from deploy/prometheus-rules.yaml),
//!   evaluated by promtool over the scraped series, fires for it,
//! - a stranger's dribble and held connections to one agent's side channel leave
//!   its RTT in the other's metrics and the other's error counters for it flat,
//! - `fabricgate ping` works in both directions (and fails as documented after the cut),
//! - perftest's ib_write_lat / ib_write_bw run on the same pair, for comparison.
//!
//! Outside CI the tests skip, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;
use crate::common::{vm_json as json, vm_rc as rc, vm_read as read};

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const PEER_OF_A: &str = "169.254.78.2";
const PEER_OF_B: &str = "169.254.78.1";

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn boot() -> &'static Result<PathBuf, String> {
    static BOOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        common::run_vm_once(
            "run-pair.sh",
            1500,
            "peers-vm",
            "peers-scenarios.sh",
            &[],
            "{a,b}/{steps.log,stderr,console.log,agent.log}",
        )
    })
}

fn results() -> Option<&'static Path> {
    common::vm_results(boot())
}

/// The wire checks of both VMs (tests/vm/wire_echo.py: ICMP over eth0 on its own, without
/// RDMA) at `names`, for failure messages: a dead emulated wire is not a failure of RDMA.
fn wire_report(dir: &Path, names: &[&str]) -> String {
    let mut out = String::from("the wire under rxe0 (ICMP over eth0):");
    for role in ["a", "b"] {
        for name in names {
            let file = dir.join(role).join(format!("wire_{name}.json"));
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| format!("({e})"));
            out.push_str(&format!("\n  {role} {name}: {}", text.trim()));
        }
    }
    out.push_str(&format!(
        "\n  counters every 2 s: {0}/{{a,b}}/net.log, {0}/host-net.log; kernel log: \
         {0}/{{a,b}}/dmesg.log",
        dir.display()
    ));
    out
}

/// One sample of the exposition: metric name, labels (sorted), value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Sample {
    fn key(&self) -> (String, Vec<(String, String)>) {
        (
            self.name.clone(),
            self.labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    }
}

/// Parse the classic text format (label values here never hold `,` or `"`).
fn parse_exposition(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|kv| !kv.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_owned(), v.trim_matches('"').to_owned()))
                })
                .collect();
            Some(Sample {
                name: name.to_owned(),
                labels,
                value,
            })
        })
        .collect()
}

/// A VM's scrapes in order: (guest wall time in ms, samples).
fn scrapes(dir: &Path, role: &str) -> Vec<(u64, Vec<Sample>)> {
    let vm = dir.join(role).join("scrapes");
    read(&vm.join("index"))
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(i, t)| {
            let samples = parse_exposition(&read(&vm.join(format!("{i}.prom"))));
            (t.trim().parse().unwrap(), samples)
        })
        .collect()
}

fn find<'a>(samples: &'a [Sample], name: &str, want: &[(&str, &str)]) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| {
            s.name == name
                && want
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect()
}

fn value(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> Option<f64> {
    find(samples, name, want).first().map(|s| s.value)
}

fn cut_at_ms(dir: &Path) -> u64 {
    read(&dir.join("sync/cut_at_ms")).trim().parse().unwrap()
}

/// The last scrape before the cut in which the VM had RTT for its peer.
fn before_cut(dir: &Path, role: &str, peer: &str) -> Vec<Sample> {
    let cut = cut_at_ms(dir);
    scrapes(dir, role)
        .into_iter()
        .rev()
        .find(|(t, s)| {
            *t < cut
                && value(
                    s,
                    "fabricgate_peer_rtt_seconds",
                    &[("peer", peer), ("stat", "median")],
                )
                .is_some()
        })
        .unwrap_or_else(|| panic!("{role}: no scrape with RTT for {peer} before the cut"))
        .1
}

#[test]
fn both_agents_report_rtt_and_bandwidth_for_each_other() {
    let Some(dir) = results() else { return };
    for (role, peer) in [("a", PEER_OF_A), ("b", PEER_OF_B)] {
        let s = before_cut(dir, role, peer);
        let rtt = |stat| {
            value(
                &s,
                "fabricgate_peer_rtt_seconds",
                &[
                    ("device", "rxe0"),
                    ("port", "1"),
                    ("peer", peer),
                    ("stat", stat),
                ],
            )
            .unwrap_or_else(|| panic!("{role}: no {stat} RTT for {peer}"))
        };
        let (min, median, max) = (rtt("min"), rtt("median"), rtt("max"));
        assert!(
            min > 0.0 && min <= median && median <= max,
            "{role}: {min} {median} {max}"
        );
        // Under TCG a round trip takes milliseconds, never a minute.
        assert!(max < 10.0, "{role}: {max}");
        let bw = value(
            &s,
            "fabricgate_peer_bandwidth_bytes_per_second",
            &[("device", "rxe0"), ("port", "1"), ("peer", peer)],
        )
        .unwrap_or_else(|| panic!("{role}: no bandwidth for {peer}"));
        assert!(bw > 0.0, "{role}: {bw}");
        // Bytes never arrive wrong. (On an overloaded TCG host a session now and then
        // overruns its 20 s bound: timeouts are reported, not asserted away.)
        assert_eq!(
            value(
                &s,
                "fabricgate_peer_errors_total",
                &[("peer", peer), ("kind", "verification")]
            ),
            Some(0.0),
            "{role}: verification errors before the cut"
        );
        let failed: f64 = ["connect", "timeout"]
            .iter()
            .filter_map(|k| {
                value(
                    &s,
                    "fabricgate_peer_errors_total",
                    &[("peer", peer), ("kind", k)],
                )
            })
            .sum();
        let rounds = value(&s, "fabricgate_peer_rounds_total", &[]).unwrap_or(0.0);
        assert!(
            failed < rounds / 2.0,
            "{role}: {failed} failures in {rounds} rounds before the cut"
        );
        // The other agent's responder served our sessions.
        let served = value(
            &s,
            "fabricgate_peer_responder_sessions_total",
            &[("result", "served")],
        )
        .unwrap();
        assert!(served >= 1.0, "{role}: responder served {served}");
        let cpu = value(&s, "fabricgate_peer_round_cpu_seconds", &[]).unwrap();
        assert!(cpu > 0.0, "{role}: round CPU {cpu}");
        eprintln!(
            "{role} -> {peer}: RTT min/median/max {:.1}/{:.1}/{:.1} ms, RDMA WRITE {:.2} MB/s, \
             CPU of the last round {:.0} ms",
            min * 1e3,
            median * 1e3,
            max * 1e3,
            bw / 1e6,
            cpu * 1e3
        );
    }
}

/// Write a promtool test that evaluates `count by (peer) (EXPR)` over the scraped
/// `fabricgate_peer_*` series of both VMs (1 s slots on the guests' wall clock), with
/// staleness markers where a series disappeared from a scrape, as Prometheus would.
fn sync_ms(dir: &Path, name: &str) -> u64 {
    read(&dir.join("sync").join(name)).trim().parse().unwrap()
}

/// The sum of `name`'s samples matching `want` (0 when there are none).
fn total(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    find(samples, name, want).iter().map(|s| s.value).sum()
}

/// On real RDMA: a stranger in VM a (its own address, no key) dribbles a byte every
/// 2 s to a's responder from 4 connections and holds 64 idle ones for 20 s, while b measures
/// a. The responder cuts every dribbler at the frame deadline and answers the held ones BUSY;
/// b's rounds go on and are served, a's RTT stays in every scrape of b, and b's error
/// counters for a do not move.
#[test]
fn redteam_a_strangers_dribble_and_hold_leave_the_victims_rtt_and_errors_alone() {
    let Some(dir) = results() else { return };
    assert_eq!(
        rc(&dir.join("a/attack.rc")),
        0,
        "{}",
        read(&dir.join("a/attack.stderr"))
    );
    let attack = json(&dir.join("a/attack.json"));
    assert!(attack["dribble_sessions"].as_u64() >= Some(4), "{attack}");
    assert!(
        attack["dribble_longest_s"]
            .as_f64()
            .is_some_and(|s| s < 8.0),
        "a dribbler kept a session past the deadlines (3 s a frame, 6 s unauthenticated): {attack}"
    );
    assert!(attack["hold_opened"].as_u64() >= Some(16), "{attack}");

    let start = parse_exposition(&read(&dir.join("b/attack_start.prom")));
    let end = parse_exposition(&read(&dir.join("b/attack_end.prom")));
    let errors = |s: &[Sample]| total(s, "fabricgate_peer_errors_total", &[("peer", PEER_OF_B)]);
    assert_eq!(
        errors(&end),
        errors(&start),
        "b recorded errors against the attacked a: {:?}\n{}",
        find(&end, "fabricgate_peer_errors_total", &[("peer", PEER_OF_B)]),
        wire_report(dir, &["before_attack", "after_attack"])
    );
    let rounds = |s: &[Sample]| value(s, "fabricgate_peer_rounds_total", &[]).unwrap_or(0.0);
    assert!(
        rounds(&end) >= rounds(&start) + 3.0,
        "b's rounds stalled during the attack: {} -> {}",
        rounds(&start),
        rounds(&end)
    );
    let (from, to) = (
        sync_ms(dir, "attack_start_ms"),
        sync_ms(dir, "attack_end_ms"),
    );
    let during: Vec<_> = scrapes(dir, "b")
        .into_iter()
        .filter(|(t, _)| (from..=to).contains(t))
        .collect();
    assert!(
        during.len() >= 5,
        "{} scrapes of b during the attack",
        during.len()
    );
    for (t, s) in &during {
        assert!(
            value(
                s,
                "fabricgate_peer_rtt_seconds",
                &[("peer", PEER_OF_B), ("stat", "median")]
            )
            .is_some(),
            "b's scrape at {t} has no RTT for the attacked a"
        );
    }

    let a_start = parse_exposition(&read(&dir.join("a/attack_start.prom")));
    let a_end = parse_exposition(&read(&dir.join("a/attack_end.prom")));
    let sessions = |s: &[Sample], result| {
        value(
            s,
            "fabricgate_peer_responder_sessions_total",
            &[("result", result)],
        )
        .unwrap_or(0.0)
    };
    assert!(
        sessions(&a_end, "served") >= sessions(&a_start, "served") + 2.0,
        "a's responder served b during the attack"
    );
    assert!(
        sessions(&a_end, "refused") > sessions(&a_start, "refused"),
        "the stranger's connections were refused (BUSY)"
    );
}

/// A promtool unit test of `expr` over the scrapes of `roles` (the timeline is both VMs',
/// so evaluation times are comparable between cases).
fn promtool_case(dir: &Path, roles: &[&str], expr: &str, evals: &[(u64, Vec<String>)]) -> String {
    let mut all: Vec<(String, u64, Vec<Sample>)> = Vec::new();
    for role in ["a", "b"] {
        for (t, samples) in scrapes(dir, role) {
            let samples = samples
                .into_iter()
                .filter(|s| s.name.starts_with("fabricgate_peer_"))
                .map(|mut s| {
                    s.labels
                        .insert("instance".into(), format!("vm-{role}:9464"));
                    s.labels.insert("job".into(), "fabricgate".into());
                    s
                })
                .collect();
            all.push((role.to_owned(), t, samples));
        }
    }
    let t0 = all.iter().map(|(_, t, _)| *t).min().unwrap();
    let slot = |t: u64| (t - t0).div_ceil(1000);
    let slots = all.iter().map(|(_, t, _)| slot(*t)).max().unwrap() as usize + 1;
    // series -> per slot: Some(value) | None (not scraped) ; and which slots each VM scraped.
    type Key = (String, Vec<(String, String)>);
    let mut series: BTreeMap<Key, Vec<Option<f64>>> = BTreeMap::new();
    let mut scraped: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    for (role, t, samples) in &all {
        if !roles.contains(&role.as_str()) {
            continue;
        }
        let i = slot(*t) as usize;
        scraped.entry(role.clone()).or_default().insert(i);
        for s in samples {
            series.entry(s.key()).or_insert_with(|| vec![None; slots])[i] = Some(s.value);
        }
    }
    let mut input = String::new();
    for ((name, labels), values) in &series {
        let role = if labels
            .iter()
            .any(|(k, v)| k == "instance" && v == "vm-a:9464")
        {
            "a"
        } else {
            "b"
        };
        let mut present = false;
        let vals: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Some(v) => {
                    present = true;
                    format!("{v}")
                }
                None if present && scraped[role].contains(&i) => {
                    present = false;
                    "stale".to_owned()
                }
                None => "_".to_owned(),
            })
            .collect();
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        input.push_str(&format!(
            "      - series: '{name}{{{}}}'\n        values: '{}'\n",
            labels.join(","),
            vals.join(" ")
        ));
    }
    let mut tests = String::new();
    for (at, peers) in evals {
        let samples: String = peers
            .iter()
            .map(|p| format!("          - labels: '{{peer=\"{p}\"}}'\n            value: 1\n"))
            .collect();
        tests.push_str(&format!(
            "      - expr: |\n          count by (peer) (\n{}\n          )\n        eval_time: {at}s\n        exp_samples:{}\n",
            expr.lines().map(|l| format!("            {l}")).collect::<Vec<_>>().join("\n"),
            if samples.is_empty() { " []\n".to_owned() } else { format!("\n{samples}") }
        ));
    }
    format!(
        "rule_files: []\nevaluation_interval: 1s\ntests:\n  - interval: 1s\n    input_series:\n{input}    promql_expr_test:\n{tests}"
    )
}

#[test]
fn eth0_down_turns_into_errors_and_the_unreachable_alert_fires_within_two_rounds() {
    let Some(dir) = results() else { return };
    let cut = cut_at_ms(dir);
    let a = scrapes(dir, "a");
    let rounds = |s: &[Sample]| value(s, "fabricgate_peer_rounds_total", &[]).unwrap_or(0.0);
    let errors = |s: &[Sample]| {
        find(s, "fabricgate_peer_errors_total", &[("peer", PEER_OF_A)])
            .iter()
            .map(|x| x.value)
            .sum::<f64>()
    };
    // a scraped its counters the moment it saw b's cut marker.
    let at_cut = parse_exposition(&read(&dir.join("a/cut.prom")));
    let (rounds_at_cut, errors_at_cut) = (rounds(&at_cut), errors(&at_cut));
    // The first scrape after the cut that shows failed rounds towards b, and no RTT for b.
    let (t_seen, seen) = a
        .iter()
        .find(|(t, s)| {
            *t > cut
                && errors(s) > errors_at_cut
                && value(
                    s,
                    "fabricgate_peer_rtt_seconds",
                    &[("peer", PEER_OF_A), ("stat", "median")],
                )
                .is_none()
        })
        .unwrap_or_else(|| panic!("a never recorded an error for {PEER_OF_A} after the cut"));
    // a has one peer and one port: every failed round adds exactly one error, so the first
    // failed round is the scrape's round count minus the errors since the cut, plus one.
    // (Scrapes can be seconds apart on a loaded host; the counters are exact.)
    let first_failed = rounds(seen) - (errors(seen) - errors_at_cut) + 1.0;
    let rounds_to_error = first_failed - rounds_at_cut;
    assert!(
        rounds_to_error <= 2.0,
        "the first failed round came {rounds_to_error} rounds after the cut (rounds at the \
         cut {rounds_at_cut}, at the scrape {}, errors since {})",
        rounds(seen),
        errors(seen) - errors_at_cut
    );
    let kinds: Vec<String> = find(seen, "fabricgate_peer_errors_total", &[("peer", PEER_OF_A)])
        .iter()
        .filter(|s| s.value > 0.0)
        .map(|s| s.labels["kind"].clone())
        .collect();
    assert!(
        kinds.iter().all(|k| k == "connect" || k == "timeout"),
        "{kinds:?}"
    );

    // The alert's expression, as deployed, over what was scraped, evaluated by promtool:
    // quiet before the cut, firing for b by the scrape above.
    let rules: Value =
        serde_norway::from_str(&read(&manifest_dir().join("deploy/prometheus-rules.yaml")))
            .unwrap();
    let expr = rules["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["alert"] == "FabricgatePeerUnreachable")
        .expect("FabricgatePeerUnreachable in deploy/prometheus-rules.yaml")["expr"]
        .as_str()
        .unwrap()
        .trim()
        .to_owned();
    let t0 = a
        .iter()
        .map(|(t, _)| *t)
        .chain(scrapes(dir, "b").iter().map(|(t, _)| *t))
        .min()
        .unwrap();
    let at = |t: u64| (t - t0).div_ceil(1000);
    // Quiet on both VMs before the cut; firing for b on a's series by the scrape above. (b's
    // own view after the cut is not asserted here: a round of b's that was under way when its
    // link went down may count one error for a, and then the alert rightly fires there too.)
    let quiet = promtool_case(dir, &["a", "b"], &expr, &[(at(cut) - 1, Vec::new())]);
    let firing = promtool_case(
        dir,
        &["a"],
        &expr,
        &[(at(*t_seen), vec![PEER_OF_A.to_owned()])],
    );
    for (name, case) in [("quiet", quiet), ("firing", firing)] {
        let file = dir.join(format!("unreachable_{name}_test.yaml"));
        std::fs::write(&file, &case).unwrap();
        match Command::new("promtool")
            .args(["test", "rules"])
            .arg(&file)
            .output()
        {
            Ok(out) => {
                let text = common::stdout_and_stderr(&out);
                assert!(
                    out.status.success(),
                    "promtool on {}:\n{text}\n{}",
                    file.display(),
                    wire_report(dir, &["before_attack", "after_attack"])
                );
            }
            Err(e) => {
                common::require(
                    false,
                    &format!("promtool: {e}"),
                    ".ci/metrics.sh installs it",
                );
            }
        }
    }
    eprintln!(
        "eth0 down on b: a's first error for b {:.1} s later, {rounds_to_error} round(s); kinds {kinds:?}",
        (*t_seen - cut) as f64 / 1e3
    );

    // b lost its only port: its own series for a are gone, it counts no errors for a.
    let b = scrapes(dir, "b");
    let (_, b_last) = b.last().unwrap();
    assert!(
        value(
            b_last,
            "fabricgate_peer_rtt_seconds",
            &[("peer", PEER_OF_B), ("stat", "median")]
        )
        .is_none(),
        "b still exports RTT for a without a usable port"
    );
}

#[test]
fn fabricgate_ping_works_both_ways_and_fails_as_documented_after_the_cut() {
    let Some(dir) = results() else { return };
    for (role, other) in [("a", "b"), ("b", "a")] {
        let d = dir.join(role);
        let doc = json(&d.join("ping.json"));
        assert_eq!(rc(&d.join("ping.rc")), 0, "{role}: {doc}");
        assert_eq!(doc["ok"], true);
        let port = &doc["ports"][0];
        assert_eq!(port["device"], "rxe0");
        assert_eq!(port["peer_node"], format!("vm-{other}"));
        assert_eq!(port["peer_device"], "rxe0");
        let rtt = &port["rtt_us"];
        let (min, p50, max) = (
            rtt["min"].as_f64().unwrap(),
            rtt["p50"].as_f64().unwrap(),
            rtt["max"].as_f64().unwrap(),
        );
        assert!(min > 0.0 && min <= p50 && p50 <= max, "{role}: {rtt}");
        assert!(
            port["bandwidth_bytes_per_second"].as_f64().unwrap() > 0.0,
            "{port}"
        );
        let table = read(&d.join("ping.txt"));
        assert_eq!(rc(&d.join("ping_table.rc")), 0, "{table}");
        assert!(
            table.contains("reachable") && table.contains("rxe0/1"),
            "{table}"
        );
        assert!(
            table.contains("RTT P50") && table.contains("B/s"),
            "{table}"
        );
    }
    // After b took eth0 down: from a the peer is unreachable (exit 1, a peer error kind);
    // on b there is no usable local port (exit 3).
    let a = json(&dir.join("a/ping_cut.json"));
    assert_eq!(rc(&dir.join("a/ping_cut.rc")), 1, "{a}");
    let kind = a["ports"][0]["error_kind"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(kind == "connect" || kind == "timeout", "{a}");
    let b = json(&dir.join("b/ping_cut.json"));
    assert_eq!(rc(&dir.join("b/ping_cut.rc")), 3, "{b}");
    assert!(
        b["errors"][0]
            .as_str()
            .unwrap()
            .contains("no usable local RDMA port"),
        "{b}"
    );
}

/// Numbers of a perftest result table: the row after the header containing `column`, by
/// column name. Header words without a unit (`99%`, `BW`) belong to the next word
/// (`99% percentile[usec]`, `BW average[MB/sec]`); `#bytes` and `#iterations` stand alone.
pub(crate) fn perftest_row(text: &str, column: &str) -> Option<BTreeMap<String, f64>> {
    let lines: Vec<&str> = text.lines().collect();
    let h = lines.iter().position(|l| l.contains(column))?;
    let mut header: Vec<String> = Vec::new();
    let mut pending = String::new();
    for word in lines[h].split_whitespace() {
        if !word.contains('[') && !word.starts_with('#') {
            pending.push_str(word);
            pending.push(' ');
            continue;
        }
        header.push(format!("{pending}{word}"));
        pending.clear();
    }
    let row: Vec<f64> = lines
        .get(h + 1)?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    (row.len() == header.len()).then(|| header.into_iter().zip(row).collect())
}

/// Each try of perftest's `name` in both VMs (peers-scenarios.sh, perftest_pair): its status
/// and what it printed, for failure messages and for the report of a second try.
fn perftest_tries(dir: &Path, name: &str) -> String {
    let mut out = format!("{name}, each try in both VMs:");
    for role in ["a", "b"] {
        for try_no in 1..=2 {
            let file = dir.join(role).join(format!("{name}.try{try_no}.txt"));
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            let status =
                std::fs::read_to_string(dir.join("sync").join(format!("{role}.{name}_rc{try_no}")))
                    .unwrap_or_else(|e| format!("({e})"));
            out.push_str(&format!(
                "\n--- {role} try {try_no}, status {}:\n{}",
                status.trim(),
                text.trim_end()
            ));
        }
    }
    out.push('\n');
    out
}

#[test]
fn perftest_tables_parse_by_column_name() {
    let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
               t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
               64      200          3337.78        77165.58      35800.80  \t       37144.97     \
               \t11158.24\t\t70192.64 \t\t77165.58\n";
    let l = perftest_row(lat, "t_typical").unwrap();
    assert_eq!(l["t_typical[usec]"], 35800.80);
    assert_eq!(l["99% percentile[usec]"], 70192.64);
    let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
              65536      400              2.86               2.18   \t\t   0.000035\n";
    let w = perftest_row(bw, "BW average").unwrap();
    assert_eq!(w["BW average[MB/sec]"], 2.18);
    assert_eq!(w["#iterations"], 400.0);
}

#[test]
fn perftest_runs_between_the_same_vms_for_comparison() {
    let Some(dir) = results() else { return };
    let b = dir.join("b");
    let lat = read(&b.join("ib_write_lat.txt"));
    let bw = read(&b.join("ib_write_bw.txt"));
    if rc(&b.join("ib_write_lat.rc")) == 127
        && !common::require(
            false,
            "perftest is not installed",
            "apt-get install perftest, .ci/vm.sh",
        )
    {
        return;
    }
    // The wire answered before perftest started (the peer's MAC resolved; wire_echo.py).
    let wire = json(&b.join("wire_before_perftest.json"));
    assert_eq!(
        wire["answered"],
        true,
        "{}",
        wire_report(dir, &["after_attack", "before_perftest"])
    );
    for role in ["a", "b"] {
        for name in ["ib_write_lat", "ib_write_bw"] {
            assert_eq!(
                rc(&dir.join(role).join(format!("{name}.rc"))),
                0,
                "{role}: {}\n{}",
                perftest_tries(dir, name),
                wire_report(dir, &["before_perftest"])
            );
        }
    }
    let l = perftest_row(&lat, "t_typical").unwrap_or_else(|| panic!("{lat}"));
    let w = perftest_row(&bw, "BW average").unwrap_or_else(|| panic!("{bw}"));
    let typical = l
        .iter()
        .find(|(k, _)| k.starts_with("t_typical"))
        .unwrap()
        .1;
    let avg = w
        .iter()
        .find(|(k, _)| k.starts_with("BW average"))
        .unwrap()
        .1;
    assert!(*typical > 0.0 && *avg > 0.0, "{l:?} {w:?}");
    let fg = json(&b.join("ping.json"));
    let p50 = fg["ports"][0]["rtt_us"]["p50"].as_f64().unwrap();
    let fg_bw = fg["ports"][0]["bandwidth_bytes_per_second"]
        .as_f64()
        .unwrap();
    // A second try (peers-scenarios.sh, perftest_pair) is said, with what the first printed.
    let retried: Vec<String> = ["ib_write_lat", "ib_write_bw"]
        .iter()
        .filter(|name| b.join(format!("{name}.try2.txt")).exists())
        .map(|name| perftest_tries(dir, name))
        .collect();
    let summary = format!(
        "b -> a under TCG: ib_write_lat t_typical {typical:.1} us (one way; x2 = {:.1} us round \
         trip) vs fabricgate RTT p50 {p50:.1} us; ib_write_bw 64 KiB average {avg:.2} MB/s vs \
         fabricgate {:.2} MB/s\n{}",
        2.0 * typical,
        fg_bw / 1e6,
        retried.join("")
    );
    std::fs::write(dir.join("comparison.txt"), &summary).unwrap();
    eprint!("{summary}");
}

#[test]
fn agents_stop_cleanly() {
    let Some(dir) = results() else { return };
    for role in ["a", "b"] {
        let log = read(&dir.join(role).join("agent.log"));
        assert_eq!(rc(&dir.join(role).join("agent.rc")), 0, "{log}");
        assert!(!log.contains("panicked"), "{log}");
        assert!(log.contains("peer responder listening"), "{log}");
    }
}
