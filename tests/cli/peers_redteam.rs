//! The red team's peer-channel attacks against real agents over loopback: two
//! `fabricgate run --dry-run` agents with peers on, measuring each other from the fixture
//! node's `mlx5_0` (no RDMA device here, so a measurement that passes the side channel ends
//! at the local verbs step: kind `local`, never an error blamed on the peer; the RTT itself
//! needs RDMA and is covered by tests/vm/peers_vm.rs). The attackers use source addresses of
//! their own (127.0.0.9, .11, .12), as strangers on the network would.

use super::peers_cli::{Agent, KEY, free_port, get, spawn_dry_run_agent, wait_for};
use crate::common::{self, connect_from};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An agent for Node `name` over the healthy NDR fixture (only `mlx5_0` counts), its
/// responder on 127.0.0.1:`port`, measuring `peers` every second.
fn start_agent(dir: &Path, name: &str, port: u16, peers: &str) -> Agent {
    let key = dir.join("key");
    if !key.exists() {
        std::fs::write(&key, KEY).unwrap();
    }
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "rdma:\n  devices: \"mlx5_0\"\npeers:\n  enabled: true\n  listen: \"127.0.0.1:{port}\"\n  \
             interval: 1s\n  timeout: 2s\n  key_file: {}\n",
            key.display()
        ),
    )
    .unwrap();
    spawn_dry_run_agent(
        dir,
        name,
        &common::fixture("ndr-8x400-healthy").join("sys"),
        dir.join(format!("{name}.log")),
        &["--config", cfg.to_str().unwrap(), "--peers", peers],
    )
}

/// Sessions of `agent` that got through `peer`'s side channel (and stopped at the local
/// verbs step), from its log.
fn reached(agent: &Agent, peer: &str) -> usize {
    let text = std::fs::read_to_string(&agent.log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("peer measurement failed") && l.contains(&format!("peer={peer}")))
        .filter(|l| l.contains("kind=local") || l.contains("kind=\"local\""))
        .count()
}

/// `fabricgate_peer_errors_total` of `agent` for `peer`, by kind, when the series exist.
fn errors(agent: &Agent, peer: &str) -> Option<Vec<(String, f64)>> {
    let body = get(&agent.metrics, "/metrics")?;
    let want = format!("peer=\"{peer}\"");
    let rows: Vec<(String, f64)> = body
        .lines()
        .filter(|l| l.starts_with("fabricgate_peer_errors_total{") && l.contains(&want))
        .filter_map(|l| {
            let kind = l.split("kind=\"").nth(1)?.split('"').next()?.to_owned();
            Some((kind, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    (rows.len() == 3).then_some(rows)
}

fn metric(agent: &Agent, line_prefix: &str) -> f64 {
    get(&agent.metrics, "/metrics")
        .and_then(|b| {
            b.lines()
                .find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Read until the other side closes or `limit` passes.
fn drain(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let end = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    while Instant::now() < end {
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    out
}

/// Forwards every connection to `to`; records the client's bytes of the first one.
fn recording_relay(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let tape = Arc::new(Mutex::new(Vec::new()));
    let rec = Arc::clone(&tape);
    std::thread::spawn(move || {
        for (n, conn) in l.incoming().enumerate() {
            let Ok(mut client) = conn else { continue };
            let Ok(mut server) = TcpStream::connect(to) else {
                continue;
            };
            let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
                continue;
            };
            let rec = Arc::clone(&rec);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(k) = c2.read(&mut buf) {
                    if k == 0 {
                        break;
                    }
                    if n == 0 {
                        rec.lock().unwrap().extend_from_slice(&buf[..k]);
                    }
                    if s2.write_all(&buf[..k]).is_err() {
                        break;
                    }
                }
                let _ = s2.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut server, &mut client);
                let _ = client.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (at, tape)
}

fn names(bytes: &[u8], what: &[u8]) -> bool {
    bytes.windows(what.len()).any(|w| w == what)
}

/// A frame of protocol version 2 with `payload` and a zero MAC.
fn frame(kind: u8, payload: &[u8]) -> [u8; 256] {
    let mut f = [0u8; 256];
    f[..4].copy_from_slice(b"FGPR");
    f[4..6].copy_from_slice(&2u16.to_be_bytes());
    f[6] = kind;
    f[8..8 + payload.len()].copy_from_slice(payload);
    f
}

/// Before (35f8061): a dribbler (a byte every 2 s) kept sessions open for 40 s and idle
/// connections took all 4 sessions, so the other agents recorded `connect` errors against
/// the healthy victim (the unreachable alert, a taint where peers are required); a stranger
/// learnt the node's name from any refusal. Now, with dribblers, connect-and-hold, a
/// replayed recorded session and a wrong-key client all running at once against node-a for
/// 8 s: node-b's error counters for node-a stay at 0 throughout, node-b keeps getting
/// through node-a's side channel during and after the attack, and no attacker ever reads
/// node-a's name.
#[test]
fn redteam_attacks_on_a_responder_leave_its_peers_error_counters_flat() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    let a_addr: SocketAddr = format!("127.0.0.1:{pa}").parse().unwrap();
    let (relay, tape) = recording_relay(a_addr);
    let a = start_agent(dir.path(), "node-a", pa, &format!("127.0.0.1:{pb}"));
    let b = start_agent(dir.path(), "node-b", pb, &format!("127.0.0.1:{pa},{relay}"));
    let victim = format!("127.0.0.1:{pa}");
    let zero = |rows: &[(String, f64)]| rows.iter().all(|(_, v)| *v == 0.0);
    wait_for("node-b to get through node-a's side channel", || {
        (reached(&b, &victim) >= 2 && errors(&b, &victim).is_some()).then_some(())
    });
    // The relay recorded one of node-b's sessions: OPEN and HELLO.
    let recorded = wait_for("a recorded session", || {
        let t = tape.lock().unwrap().clone();
        (t.len() >= 512).then_some(t)
    });
    let key_id: Vec<u8> = recorded[8 + 16 + 1..8 + 16 + 1 + 8].to_vec();

    let stop = Arc::new(AtomicBool::new(false));
    let leaked = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let mut attackers = Vec::new();
    // 4 dribblers, a byte every 2 s, reconnecting when cut.
    for _ in 0..4 {
        let (stop, leaked) = (Arc::clone(&stop), Arc::clone(&leaked));
        attackers.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = connect_from([127, 0, 0, 9], a_addr) else {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                for b in b"FGPR\0\x02\x06\0" {
                    if stop.load(Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                        break;
                    }
                    let got = drain(&mut s, Duration::from_secs(2));
                    if names(&got, b"node-a") {
                        leaked.store(true, Ordering::Relaxed);
                    }
                    if !got.is_empty() {
                        break;
                    }
                }
            }
        }));
    }
    // Connect-and-hold: 20 idle connections at a time, from the dribblers' address (one
    // address gets MAX_PER_SOURCE sessions; with many addresses all slots can be taken, and
    // the pool's clients are told BUSY, a skip: probes' redteam_connect_and_hold test).
    {
        let stop = Arc::clone(&stop);
        attackers.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut held: Vec<TcpStream> = (0..20)
                    .filter_map(|_| connect_from([127, 0, 0, 9], a_addr).ok())
                    .collect();
                std::thread::sleep(Duration::from_millis(500));
                for s in &mut held {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(10)));
                }
                held.retain_mut(|s| {
                    let mut b = [0u8; 256];
                    !matches!(s.read(&mut b), Ok(0) | Ok(256))
                });
                std::thread::sleep(Duration::from_millis(500));
            }
        }));
    }
    // The recorded session replayed, and a client without the key (its own key id, then
    // the pool's id seen on the wire with a forged MAC).
    for (src, what) in [([127, 0, 0, 11], "replay"), ([127, 0, 0, 12], "wrong key")] {
        let (stop, leaked, refused) =
            (Arc::clone(&stop), Arc::clone(&leaked), Arc::clone(&refused));
        let recorded = recorded.clone();
        let key_id = key_id.clone();
        attackers.push(std::thread::spawn(move || {
            let mut i = 0u8;
            while !stop.load(Ordering::Relaxed) {
                i = i.wrapping_add(1);
                let Ok(mut s) = connect_from(src, a_addr) else {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                let bytes: Vec<u8> = match what {
                    "replay" => recorded[..512].to_vec(),
                    _ if i.is_multiple_of(2) => {
                        let mut p = vec![i; 16];
                        p.push(1);
                        p.extend_from_slice(&[0xee; 8]);
                        frame(6, &p).to_vec()
                    }
                    _ => {
                        let mut p = vec![i; 16];
                        p.push(1);
                        p.extend_from_slice(&key_id);
                        let mut out = frame(6, &p).to_vec();
                        out.extend_from_slice(&recorded[256..512]);
                        out
                    }
                };
                let _ = s.write_all(&bytes);
                let got = drain(&mut s, Duration::from_secs(3));
                if names(&got, b"node-a") {
                    leaked.store(true, Ordering::Relaxed);
                }
                // The last frame: status AUTH (10), or BUSY (1) when the slots were full.
                if got.len() >= 256 && got[got.len() - 256 + 7] == 10 {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }

    let reached_before = reached(&b, &victim);
    let rounds_before = metric(&b, "fabricgate_peer_rounds_total ");
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        let rows = errors(&b, &victim).expect("node-b keeps node-a's error series");
        assert!(
            zero(&rows),
            "node-b counted errors against node-a: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, Ordering::Relaxed);
    for t in attackers {
        t.join().unwrap();
    }
    assert!(
        !leaked.load(Ordering::Relaxed),
        "an attacker read node-a's name"
    );
    assert!(
        refused.load(Ordering::Relaxed) >= 4,
        "the replays and forgeries were refused"
    );
    assert!(
        metric(&b, "fabricgate_peer_rounds_total ") >= rounds_before + 4.0,
        "node-b's rounds went on"
    );
    let during = reached(&b, &victim);
    assert!(
        during > reached_before,
        "node-b got through during the attack"
    );
    wait_for("node-b to get through after the attack", || {
        (reached(&b, &victim) > during).then_some(())
    });
    let rows = errors(&b, &victim).unwrap();
    assert!(zero(&rows), "{rows:?}");
    let unauth = metric(
        &a,
        "fabricgate_peer_responder_sessions_total{result=\"unauthenticated\"} ",
    );
    assert!(
        unauth >= 4.0,
        "node-a counted the unauthenticated sessions: {unauth}"
    );
}

/// Before (35f8061): one OTHER_GROUP answer from whoever held the address for a moment made
/// every agent leave the node out of its rounds until restart. Now a squatter's answers
/// (a version-1 OTHER_GROUP naming another node, a bare version-2 OTHER_GROUP) are not
/// believed: when the real agent takes the address, node-b measures it at once.
#[test]
fn redteam_a_squatters_other_group_does_not_remove_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    let squatter = TcpListener::bind(("127.0.0.1", pa)).unwrap();
    let b = start_agent(dir.path(), "node-b", pb, &format!("127.0.0.1:{pa}"));
    let mut v1 = [0u8; 256];
    v1[..4].copy_from_slice(b"FGPR");
    v1[4..6].copy_from_slice(&1u16.to_be_bytes());
    v1[6] = 2;
    v1[7] = 3;
    v1[8..14].copy_from_slice(b"node-x");
    for answer in [v1, frame(7, &[]), {
        let mut f = frame(7, &[]);
        f[7] = 3;
        f
    }] {
        let (mut s, _) = squatter.accept().unwrap();
        let mut open = [0u8; 256];
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read_exact(&mut open);
        let _ = s.write_all(&answer);
        drop(drain(&mut s, Duration::from_secs(1)));
    }
    drop(squatter);
    let victim = format!("127.0.0.1:{pa}");
    let _a = start_agent(dir.path(), "node-a", pa, &format!("127.0.0.1:{pb}"));
    wait_for("node-b to measure node-a after the squatter", || {
        (reached(&b, &victim) >= 2).then_some(())
    });
    let text = std::fs::read_to_string(&b.log).unwrap();
    assert!(
        !text.contains("skipped for the next rounds"),
        "an unauthenticated OTHER_GROUP was believed: {text}"
    );
}
