//! Runtime transport per pod on real kernels: two Soft-RoCE VMs
//! (tests/vm/run-pair.sh) and tests/vm/transport-scenarios.sh. In VM a, one "pod" (a real
//! cgroup v2 under a kubepods-shaped path, systemd driver naming) runs `ibv_rc_pingpong` to b
//! over rxe0 (an RC QP in RTS moving data), another sends bulk TCP to b over eth0, the netdev
//! under rxe0 (the IPoIB-like case). The shipped binary's `fabricgate check --format json
//! --pods-window 5s` in a must call the first `rdma` and the second `sockets`, by pod UID,
//! with the facts right; the node byte heuristic's answer over the same window is shown
//! beside it. Then a third pod holds an idle RC QP (stopped in RTS): beside bulk TCP it is
//! `sockets`/`SocketsBesideIdleQueuePairs`; beside perftest's ib_write_bw from the same pod, its
//! port's bytes in `check` follow what perftest moved. One boot of the pair serves every test
//! here.
//!
//! Outside CI the tests skip, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;
use crate::common::{vm_json as json, vm_rc as rc, vm_read as read};

use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

const RDMA_POD: &str = "7d1e5a3c-2b4f-4c6d-8e9f-0a1b2c3d4e5f";
const TCP_POD: &str = "9a8b7c6d-5e4f-4a3b-9c2d-1e0f2a3b4c5d";
/// `runtime.tcp_min_bytes_per_second` of the scenario's requirements: 1 MB/s, not the
/// default 10 MB/s, because TCP between two emulated (TCG) machines moves only a few MB/s.
const TCP_MIN_BYTES_PER_SECOND: u64 = 1_000_000;
const PEER: &str = "169.254.77.2";
const IDLE_POD: &str = "5c4b3a29-1807-4f6e-9d5c-4b3a29180706";

fn boot() -> &'static Result<PathBuf, String> {
    static BOOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        common::run_vm_once(
            "run-pair.sh",
            600,
            "transport-vm",
            "transport-scenarios.sh",
            &[],
            "{a,b}/{steps.log,stderr,console.log,check.stderr,check_idle.stderr,check_bw.stderr,ib_write_bw.txt,ib_write_bw-server.txt}",
        )
    })
}

fn pod<'a>(doc: &'a Value, uid: &str) -> &'a Value {
    doc["pods"]
        .as_array()
        .unwrap_or_else(|| panic!("no pods[] in {doc:#}"))
        .iter()
        .find(|p| p["uid"] == uid)
        .unwrap_or_else(|| panic!("pod {uid} not listed: {:#}", doc["pods"]))
}

#[test]
fn check_tells_the_rdma_pod_from_the_pod_on_sockets_over_the_roce_netdev() {
    let Some(dir) = common::vm_results(boot()) else {
        return;
    };
    let a = dir.join("a");
    let doc = json(&a.join("check.json"));
    let stderr = read(&a.join("check.stderr"));
    // The node itself is validated (rxe0 ACTIVE); the pods section does not touch the code.
    assert_eq!(rc(&a.join("check.rc")), 0, "{stderr}\n{doc:#}");
    assert_eq!(rc(&a.join("check_off.rc")), 0);

    // The RDMA pod: its pingpong's RC QP in RTS on rxe0 port 1, owned by the process the
    // scenario started in the pod's cgroup.
    let rdma = pod(&doc, RDMA_POD);
    assert_eq!(rdma["transport"], "rdma", "{rdma:#}");
    assert_eq!(
        (&rdma["namespace"], &rdma["name"]),
        (&"".into(), &"".into())
    );
    let pid: u64 = read(&a.join("rdma_pid")).trim().parse().unwrap();
    let qps = rdma["qps"].as_array().unwrap();
    assert!(!qps.is_empty(), "{rdma:#}");
    let rc_qp = qps
        .iter()
        .find(|q| q["type"] == "RC" && q["state"] == "RTS")
        .unwrap_or_else(|| panic!("no RC QP in RTS: {rdma:#}"));
    assert_eq!(rc_qp["device"], "rxe0");
    assert_eq!(rc_qp["port"], 1);
    assert_eq!(rc_qp["pid"], pid, "{rdma:#}");
    // The kernel's own listing names the same QP and owner.
    let listing = read(&a.join("rdma-res-show-qp.txt"));
    let lqpn = rc_qp["lqpn"].as_u64().unwrap();
    assert!(
        listing.lines().any(|l| l.contains(&format!("lqpn {lqpn} "))
            && l.contains("type RC state RTS")
            && l.contains(&format!("pid {pid} "))),
        "{listing}"
    );
    let why = rdma["why"].as_str().unwrap();
    assert!(why.starts_with("1 data-path QP in RTS"), "{why}");
    // And it moved data while check sampled: rxe0's packets sent went up (only the pingpong
    // uses rxe0 here).
    let sent = |name: &str| -> u64 { read(&a.join(name)).trim().parse().unwrap() };
    let (before, after) = (sent("rxe_sent_before"), sent("rxe_sent_after"));
    assert!(after > before + 100, "rxe0 sent_pkts {before} -> {after}");

    // The sockets pod: no QP, bulk TCP to the other VM, above the threshold over the window,
    // through eth0 (the RoCE port's own netdev).
    let tcp = pod(&doc, TCP_POD);
    assert_eq!(tcp["transport"], "sockets", "{tcp:#}");
    assert_eq!(tcp["qps"], Value::Array(Vec::new()), "{tcp:#}");
    let window = doc["pods_sample"]["window_seconds"].as_f64().unwrap();
    assert!((5.0..15.0).contains(&window), "{window}");
    let bytes = tcp["internode_tcp_bytes"].as_u64().unwrap();
    let threshold = TCP_MIN_BYTES_PER_SECOND * 5;
    assert!(bytes >= threshold, "{bytes} B < {threshold} B: {tcp:#}");
    let why = tcp["why"].as_str().unwrap();
    assert!(
        why.starts_with("0 data-path QPs;")
            && why.contains(" over TCP with 1 peer in ")
            && why.ends_with(" s via eth0"),
        "{why}"
    );
    // The kernel's socket list: the pod's connection to the other VM's eth0 address.
    let ss = read(&a.join("ss.txt"));
    assert!(ss.contains(&format!("{PEER}:5001")), "{ss}");
    // Nothing else of the node is a pod (the side channel, the sink are host processes).
    assert_eq!(
        doc["pods"].as_array().unwrap().len(),
        2,
        "{:#}",
        doc["pods"]
    );

    // The node heuristic over the same window says nothing: rxe0 has no port byte counters,
    // so the RDMA side of "TCP busy, RDMA idle" is unknown. (On InfiniBand the TCP over IPoIB
    // counts in the port's own port_xmit_data, so RDMA is not idle and it says nothing
    // either.) The pods section names the pod on sockets regardless.
    let fallback = &doc["pods_sample"]["node_fallback"];
    assert_eq!(fallback["suspected"], false, "{fallback:#}");
    assert!(
        fallback["why"]
            .as_str()
            .unwrap()
            .starts_with("says nothing: the RDMA ports in scope have no byte counters"),
        "{fallback:#}"
    );
    let tcp_rate = fallback["tcp_bytes_per_second"].as_f64().unwrap();
    assert!(
        tcp_rate * window >= bytes as f64 * 0.5,
        "{tcp_rate} {bytes}"
    );

    let detect_ms = common::vm_timings(&a)["detect_ms"];
    eprintln!(
        "figure: check's pods section named the pod on sockets {:.1} s after its first bulk TCP \
         (--pods-window 5s, TCG), {bytes} B over {window:.1} s ({:.1} MB/s) via eth0; node \
         heuristic over the same window: {}",
        detect_ms as f64 / 1e3,
        bytes as f64 / window / 1e6,
        fallback["why"].as_str().unwrap()
    );
}

#[test]
fn the_table_names_both_pods_and_pods_off_leaves_the_section_out() {
    let Some(dir) = common::vm_results(boot()) else {
        return;
    };
    let a = dir.join("a");
    let table = read(&a.join("check.txt"));
    assert_eq!(rc(&a.join("check_table.rc")), 0, "{table}");
    let row = |uid: &str| {
        table
            .lines()
            .find(|l| l.trim_start().starts_with(uid))
            .unwrap_or_else(|| panic!("no row for {uid}:\n{table}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let rdma = row(RDMA_POD);
    assert_eq!(rdma[1], "rdma", "{table}");
    assert!(
        rdma[2].parse::<u32>().unwrap() >= 1 && rdma[3] == "RC",
        "{table}"
    );
    let tcp = row(TCP_POD);
    assert_eq!(tcp[1..3], ["sockets", "0"], "{table}");
    assert!(table.contains("node heuristic (fallback) over the same window: says nothing"));
    let off = json(&a.join("check_off.json"));
    assert!(off.get("pods").is_none() && off.get("pods_sample").is_none());
    assert_eq!(off["rdma"]["ready"], true);
}

/// The port rxe0/1 as `check` lists it under `pods_sample.ports`.
fn rxe_port(doc: &Value) -> &Value {
    doc["pods_sample"]["ports"]
        .as_array()
        .unwrap_or_else(|| panic!("no pods_sample.ports in {doc:#}"))
        .iter()
        .find(|p| p["device"] == "rxe0" && p["port"] == 1)
        .unwrap_or_else(|| panic!("rxe0/1 not listed: {:#}", doc["pods_sample"]))
}

/// A pod holding an RC QP in RTS that moves nothing (a pingpong stopped with SIGSTOP), while
/// it pushes bulk TCP to the other VM over eth0: the QP's presence is no alibi. rxe0/1 is that
/// pod's alone (its job, without a cluster, is the pod) and carried next to nothing by rxe's
/// own RoCE packet counters, so `check` calls it `sockets`, reason `SocketsBesideIdleQueuePairs`.
#[test]
fn an_idle_queue_pair_beside_bulk_tcp_is_sockets_beside_idle_queue_pairs() {
    let Some(dir) = common::vm_results(boot()) else {
        return;
    };
    let a = dir.join("a");
    let doc = json(&a.join("check_idle.json"));
    assert_eq!(
        rc(&a.join("check_idle.rc")),
        0,
        "{}",
        read(&a.join("check_idle.stderr"))
    );
    let idle = pod(&doc, IDLE_POD);
    let holder: u64 = read(&a.join("holder_pid")).trim().parse().unwrap();
    assert!(
        idle["qps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|q| q["type"] == "RC"
                && q["state"] == "RTS"
                && q["device"] == "rxe0"
                && q["pid"] == holder),
        "{idle:#}"
    );
    assert_eq!(idle["transport"], "sockets", "{idle:#}");
    assert_eq!(idle["reason"], "SocketsBesideIdleQueuePairs", "{idle:#}");
    assert_eq!(
        idle["rdma_ports"],
        serde_json::json!(["rxe0/1"]),
        "{idle:#}"
    );
    let tcp = idle["internode_tcp_bytes"].as_u64().unwrap();
    let rdma = idle["rdma_bytes"].as_u64().unwrap();
    assert!(tcp >= TCP_MIN_BYTES_PER_SECOND * 5, "{idle:#}");
    assert!(rdma * 10 < tcp, "{idle:#}");
    let why = idle["why"].as_str().unwrap();
    assert!(
        why.starts_with("1 data-path QP in RTS, but rxe0/1 carried ") && why.ends_with("via eth0"),
        "{why}"
    );
    // rxe0/1: the pod's own port, counted from rxe's RoCE packets (the TCP over eth0, the
    // netdev under it, is not in them: the kernel's own counter agrees).
    let port = rxe_port(&doc);
    assert_eq!(
        port["jobs"],
        serde_json::json!([{"namespace": "", "job": format!("Pod/{IDLE_POD}")}]),
        "{port:#}"
    );
    assert_eq!(
        port["counter"],
        serde_json::json!({"kind": "packets_times_mtu", "mtu": 1024})
    );
    let sent = |name: &str| -> u64 { read(&a.join(name)).trim().parse().unwrap() };
    let kernel_sent = sent("rxe_sent_idle_after") - sent("rxe_sent_idle_before");
    assert!(
        port["transmit_bytes"].as_u64().unwrap() <= kernel_sent * 1024,
        "{port:#} vs {kernel_sent} packets"
    );
    eprintln!(
        "figure: beside an idle RC QP, {tcp} B over TCP and {rdma} B on rxe0/1 in the window: {why}"
    );
}

/// perftest's ib_write_bw from the pod that holds rxe0/1, run whole inside `check`'s window:
/// the bytes the pod's port sent by `check` (rxe: RoCE packets sent × the active MTU, 1024 on
/// a 1500-byte eth0) are within 5 % of what perftest says it wrote (iterations × message size),
/// and the pod is `rdma` with its port's bytes.
#[test]
fn a_pods_port_bytes_follow_what_perftest_moved() {
    let Some(dir) = common::vm_results(boot()) else {
        return;
    };
    let a = dir.join("a");
    let perftest = read(&a.join("ib_write_bw.txt"));
    assert_eq!(rc(&a.join("ib_write_bw.rc")), 0, "{perftest}");
    let doc = json(&a.join("check_bw.json"));
    assert_eq!(
        rc(&a.join("check_bw.rc")),
        0,
        "{}",
        read(&a.join("check_bw.stderr"))
    );
    let row = crate::peers_vm::perftest_row(&perftest, "BW average")
        .unwrap_or_else(|| panic!("no result table: {perftest}"));
    let moved = row["#bytes"] * row["#iterations"];
    let port = rxe_port(&doc);
    let sent = port["transmit_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{port:#}")) as f64;
    let off = (sent - moved).abs() / moved;
    assert!(
        off <= 0.05,
        "rxe0/1 sent {sent} B by check, perftest wrote {moved} B ({:.1} % off)\n{port:#}\n{perftest}\n\
         rxe0's counters before and after:\n{}\n{}",
        off * 100.0,
        read(&a.join("hw_counters_bw_before.txt")),
        read(&a.join("hw_counters_bw_after.txt"))
    );
    let pod = pod(&doc, IDLE_POD);
    assert_eq!(pod["transport"], "rdma", "{pod:#}");
    assert_eq!(
        pod["rdma_bytes"].as_u64(),
        Some(sent as u64 + port["receive_bytes"].as_u64().unwrap()),
        "{pod:#}"
    );
    let window = doc["pods_sample"]["window_seconds"].as_f64().unwrap();
    eprintln!(
        "figure: perftest ib_write_bw wrote {moved} B ({} MB/s average by perftest); check's \
         rxe0/1 over its {window:.1} s window: {sent} B sent ({:+.2} %), {} B received (ACKs, \
         counted at the MTU)",
        row["BW average[MB/sec]"],
        (sent - moved) / moved * 100.0,
        port["receive_bytes"]
    );
}
