//! The red team's attacks on the side channel, replayed over loopback against a real
//! responder: a dribbling client, connect-and-hold, a replayed session (both ways), a client
//! with the wrong key, and a squatter's unauthenticated OTHER_GROUP; and
//! strangers holding every handshake place while a gang check's predecessor must get in.
//! After each, a client of
//! the pool still reaches the RDMA stage (`Failed { kind: None }`: the side channel let it
//! through and only this machine's missing RDMA device stopped it), or is told BUSY, which
//! is a skip and never an error.

use super::{connect_from, keys, local, responder, wait_until};
use crate::rdma::peer::wire::*;
use crate::rdma::peer::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

fn member() -> Identity {
    Identity {
        node_name: "gpu-b".into(),
        group: "pool-1".into(),
    }
}

fn victim() -> Responder {
    let r = responder(Identity {
        node_name: "gpu-a".into(),
        group: "pool-1".into(),
    });
    r.set_ports(vec![local()]);
    r
}

/// The side channel let the client through to its RDMA endpoint (which this machine cannot
/// create): no error blamed on the peer.
fn reaches_rdma(o: &Outcome) -> bool {
    matches!(o, Outcome::Failed { kind: None, .. })
}

fn measure_member(addr: SocketAddr) -> Outcome {
    measure(
        addr,
        &local(),
        &member(),
        &keys(),
        &Plan::default(),
        Duration::from_secs(5),
    )
}

/// Everything `s` sends until it closes (or `limit`), and when it closed.
fn drain(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Option<Instant>) {
    let end = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    while Instant::now() < end {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (out, Some(Instant::now())),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return (out, Some(Instant::now())),
        }
    }
    (out, None)
}

fn names_the_node(bytes: &[u8]) -> bool {
    [&b"gpu-a"[..], b"pool-1"]
        .iter()
        .any(|n| bytes.windows(n.len()).any(|w| w == *n))
}

/// Before: one byte every 2 s kept a session open past the 10 s session limit (each read
/// waited 3 s afresh). Now a frame must arrive whole within 3 s, and the handshake within
/// [`HANDSHAKE_TIMEOUT`]: four dribblers (two let in from their address, two told BUSY) are
/// all gone within 3 s, and the pool's client is served meanwhile.
#[test]
fn redteam_dribble_is_cut_at_the_frame_deadline() {
    let r = victim();
    let addr = r.local_addr();
    let started = Instant::now();
    let dribblers: Vec<_> = (0..4)
        .map(|_| {
            let mut s = connect_from([127, 0, 0, 9], addr);
            std::thread::spawn(move || {
                let t0 = Instant::now();
                // One byte of a frame every 2 s, until the responder hangs up.
                for b in b"FGPR\0\x02\x06" {
                    if s.write_all(&[*b]).is_err() {
                        break;
                    }
                    let (_, closed) = drain(&mut s, Duration::from_secs(2));
                    if closed.is_some() {
                        break;
                    }
                }
                t0.elapsed()
            })
        })
        .collect();
    assert!(wait_until(
        || r.pending_handshakes() == MAX_HANDSHAKES_PER_SOURCE
    ));
    assert!(reaches_rdma(&measure_member(addr)));
    for d in dribblers {
        let held = d.join().unwrap();
        assert!(
            held < FRAME_TIMEOUT + Duration::from_secs(2),
            "a dribbler held its session {held:?}"
        );
    }
    assert!(started.elapsed() < SESSION_LIMIT);
    assert!(wait_until(|| r.pending_handshakes() == 0));
}

/// Before: 4 idle connections took every session. Now one address gets
/// [`MAX_HANDSHAKES_PER_SOURCE`] handshake places (the rest are told BUSY at once, without a
/// name), each cut after [`HANDSHAKE_TIMEOUT`], and none of them a session slot; the pool's
/// client from another address is served throughout. When every handshake place is taken
/// from many addresses, a client that is not expected is told BUSY: a skip, not an error.
#[test]
fn redteam_connect_and_hold_cannot_take_the_responder() {
    let r = victim();
    let addr = r.local_addr();
    let held: Vec<TcpStream> = (0..50)
        .map(|_| connect_from([127, 0, 0, 9], addr))
        .collect();
    assert!(wait_until(
        || r.pending_handshakes() == MAX_HANDSHAKES_PER_SOURCE
    ));
    assert_eq!(r.active_sessions(), 0, "no session slot for a stranger");
    assert!(reaches_rdma(&measure_member(addr)));
    assert!(wait_until(
        || r.stats().refused.load(Ordering::Relaxed) >= 48
    ));
    drop(held);
    assert!(wait_until(|| r.pending_handshakes() == 0));

    // Every handshake place held, from four addresses: BUSY, recorded as a skip.
    let held = fill_handshakes(addr, 20);
    assert!(wait_until(|| r.pending_handshakes() == MAX_HANDSHAKES));
    assert_eq!(measure_member(addr), Outcome::Skipped(Skip::Busy));
    // Cut after HANDSHAKE_TIMEOUT; then served again.
    assert!(wait_until(|| r.pending_handshakes() == 0));
    assert!(reaches_rdma(&measure_member(addr)));
    drop(held);
}

/// Idle connections taking every handshake place, [`MAX_HANDSHAKES_PER_SOURCE`] from each of
/// the addresses 127.0.0.`first`, `first + 1`, ...
fn fill_handshakes(addr: SocketAddr, first: u8) -> Vec<TcpStream> {
    (0..MAX_HANDSHAKES)
        .map(|i| {
            connect_from(
                [127, 0, 0, first + (i / MAX_HANDSHAKES_PER_SOURCE) as u8],
                addr,
            )
        })
        .collect()
}

/// Before: a slot was taken at accept, before authentication, so strangers
/// (two tenant pods suffice) holding idle connections kept a gang check's predecessor out
/// until the check's deadline. Now strangers fill only the handshake pool, never a session
/// slot, and the address of the live check's predecessor has places of its own: while every
/// handshake place is held, a client of the pool from another address is told BUSY, and the
/// expected predecessor is served. An expectation ends at its deadline.
#[test]
fn redteam_idle_strangers_cannot_take_an_expected_peers_place() {
    let r = victim();
    let addr = r.local_addr();
    let predecessor = std::net::IpAddr::from([127, 0, 0, 4]);
    r.expected_peers()
        .expect(predecessor, Instant::now() + Duration::from_secs(60));
    let held = fill_handshakes(addr, 30);
    assert!(wait_until(|| r.pending_handshakes() == MAX_HANDSHAKES));
    assert_eq!(r.active_sessions(), 0);
    let from = |ip: [u8; 4]| {
        measure_from(
            Some(ip.into()),
            addr,
            &local(),
            &member(),
            &keys(),
            &Plan::default(),
            Duration::from_secs(5),
        )
    };
    assert_eq!(from([127, 0, 0, 5]), Outcome::Skipped(Skip::Busy));
    let o = from([127, 0, 0, 4]);
    assert!(reaches_rdma(&o), "{o:?}");
    // The same through greet from that address, as a node without RDMA does it.
    let port = local();
    let g = greet(
        addr,
        &member(),
        &keys(),
        &GreetOptions {
            local: Some(&port),
            source: Some(predecessor),
            timeout: Duration::from_secs(5),
            ..GreetOptions::default()
        },
    );
    assert_eq!(g.map(|g| g.peer_node), Ok("gpu-a".to_owned()));
    drop(held);
    assert!(wait_until(|| r.pending_handshakes() == 0));
    // Expired: no place beyond the pool.
    let gone = Responder::expected_peers(&r);
    gone.expect(
        std::net::IpAddr::from([127, 0, 0, 6]),
        Instant::now() - Duration::from_millis(1),
    );
    assert!(!gone.is_expected([127, 0, 0, 6].into()));
    assert!(gone.is_expected(predecessor));
}

/// A session of the pool opened by hand from `src` up to the responder's WELCOME OK, then left
/// idle (the responder, with no RDMA device here, waits for our ENDPOINT): it holds a session
/// slot until [`FRAME_TIMEOUT`].
fn welcomed(addr: SocketAddr, src: [u8; 4]) -> TcpStream {
    use super::auth::{Side, Transcript};
    let mut s = connect_from(src, addr);
    let nonce = [9u8; 16];
    let k = keys();
    let ids: Vec<_> = k.ids().collect();
    s.write_all(&encode_open(&nonce, &ids)).unwrap();
    let mut f = [0u8; FRAME_LEN];
    s.read_exact(&mut f).unwrap();
    let challenge = decode(&f).unwrap();
    assert_eq!(challenge.status, Status::Ok);
    let (theirs, key_id) = decode_challenge(&challenge.payload);
    let mut t = Transcript::new(k.by_id(&key_id).unwrap(), nonce, theirs, Side::Client);
    assert!(t.verify(&challenge.raw));
    let hello = Hello {
        identity: member(),
        device: "rxe0".into(),
        port: 1,
        plan: Plan::default(),
        tag: super::CheckTag::default(),
        greet: false,
    };
    s.write_all(&t.seal(hello.encode())).unwrap();
    s.read_exact(&mut f).unwrap();
    let welcome = decode(&f).unwrap();
    assert!(t.verify(&welcome.raw));
    assert_eq!((welcome.kind, welcome.status), (T_WELCOME, Status::Ok));
    s
}

/// A session slot is taken only once the client's HELLO authenticated, and
/// the slots are capped per address too: two clients of the pool from one address hold its
/// [`MAX_PER_SOURCE`] sessions and none of the handshake places; a third from that address is
/// told BUSY in a sealed WELCOME (a skip, believed since it is authenticated); a client from
/// another address is served.
#[test]
fn redteam_session_slots_are_taken_only_after_authentication() {
    let r = victim();
    let addr = r.local_addr();
    let held: Vec<TcpStream> = (0..MAX_PER_SOURCE)
        .map(|_| welcomed(addr, [127, 0, 0, 40]))
        .collect();
    assert!(wait_until(|| r.active_sessions() == MAX_PER_SOURCE));
    assert_eq!(
        r.pending_handshakes(),
        0,
        "authenticated: no handshake place"
    );
    let from = |ip: [u8; 4]| {
        measure_from(
            Some(ip.into()),
            addr,
            &local(),
            &member(),
            &keys(),
            &Plan::default(),
            Duration::from_secs(5),
        )
    };
    assert_eq!(from([127, 0, 0, 40]), Outcome::Skipped(Skip::Busy));
    assert!(reaches_rdma(&from([127, 0, 0, 41])));
    drop(held);
    assert!(wait_until(|| r.active_sessions() == 0));
}

/// What went to the responder, and what came back.
type Tape = Arc<Mutex<(Vec<u8>, Vec<u8>)>>;

/// A relay that records both directions of one session.
fn recording_relay(to: SocketAddr) -> (SocketAddr, Tape) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let tape = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let rec = Arc::clone(&tape);
    std::thread::spawn(move || {
        let (mut client, _) = l.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let rec2 = Arc::clone(&rec);
        let up = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = c2.read(&mut buf) {
                if n == 0 {
                    break;
                }
                rec2.lock().unwrap().0.extend_from_slice(&buf[..n]);
                if s2.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = s2.shutdown(std::net::Shutdown::Write);
        });
        let mut buf = [0u8; 4096];
        while let Ok(n) = server.read(&mut buf) {
            if n == 0 {
                break;
            }
            rec.lock().unwrap().1.extend_from_slice(&buf[..n]);
            if client.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = client.shutdown(std::net::Shutdown::Both);
        let _ = up.join();
    });
    (at, tape)
}

/// A recorded session of the pool, replayed: to the responder (its HELLO's MAC covers the
/// old responder nonce, so it is refused as unauthenticated, with nothing identifying), and
/// by a fake responder to a client (the recorded CHALLENGE's MAC covers the old client
/// nonce, so the client believes none of it).
#[test]
fn redteam_a_recorded_session_cannot_be_replayed() {
    let r = victim();
    let (relay, tape) = recording_relay(r.local_addr());
    assert!(reaches_rdma(&measure_member(relay)));
    assert!(wait_until(|| r.active_sessions() == 0));
    let (to_responder, to_client) = tape.lock().unwrap().clone();
    assert_eq!(to_responder.len(), 2 * FRAME_LEN, "OPEN and HELLO");
    assert!(to_client.len() >= 2 * FRAME_LEN, "CHALLENGE and WELCOME");

    // Replayed to the responder.
    let mut s = TcpStream::connect(r.local_addr()).unwrap();
    s.write_all(&to_responder).unwrap();
    let (answer, _) = drain(&mut s, Duration::from_secs(5));
    assert_eq!(
        answer.len(),
        2 * FRAME_LEN,
        "a fresh CHALLENGE, then the refusal"
    );
    let mut last = [0u8; FRAME_LEN];
    last.copy_from_slice(&answer[FRAME_LEN..]);
    let refusal = decode(&last).unwrap();
    assert_eq!((refusal.kind, refusal.status), (T_WELCOME, Status::Auth));
    assert!(!names_the_node(&answer), "{answer:?}");
    assert!(wait_until(|| r
        .stats()
        .unauthenticated
        .load(Ordering::Relaxed)
        == 1));

    // Replayed to a client by a fake responder: an OK WELCOME that is not believed.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let replay = to_client.clone();
    let h = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let _ = s.write_all(&replay);
        drain(&mut s, Duration::from_secs(3))
    });
    match measure_member(fake_addr) {
        Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            message,
        } => assert!(message.contains("failed authentication"), "{message}"),
        other => panic!("{other:?}"),
    }
    let (sent, _) = h.join().unwrap();
    // Our client sent OPEN only: its name went nowhere.
    assert_eq!(sent.len(), FRAME_LEN);
    assert!(!sent.windows(5).any(|w| w == b"gpu-b"));
}

/// A client with another key is refused at CHALLENGE; one that offers the pool's key id
/// (seen on the wire) but cannot MAC is refused at HELLO. Neither learns the node's name or
/// group; the pool's client is served after both.
#[test]
fn redteam_wrong_key_learns_nothing_and_is_refused() {
    let r = victim();
    let addr = r.local_addr();
    let stranger = Keys::from_secrets(&[b"not the pool's key, 32 bytes...."]);
    let mut raw = Vec::new();
    match measure(
        addr,
        &local(),
        &member(),
        &stranger,
        &Plan::default(),
        Duration::from_secs(5),
    ) {
        Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            message,
        } => assert!(message.contains("refused our authentication"), "{message}"),
        other => panic!("{other:?}"),
    }
    // By hand: the pool's key id, a HELLO with a forged MAC.
    let ids: Vec<_> = keys().ids().collect();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&encode_open(&[7; 16], &ids)).unwrap();
    let hello = Hello {
        identity: member(),
        device: "rxe0".into(),
        port: 1,
        plan: Plan::default(),
        tag: super::CheckTag::default(),
        greet: false,
    }
    .encode();
    s.write_all(&hello).unwrap();
    let (answer, _) = drain(&mut s, Duration::from_secs(5));
    raw.extend_from_slice(&answer);
    let mut last = [0u8; FRAME_LEN];
    last.copy_from_slice(&answer[answer.len() - FRAME_LEN..]);
    assert_eq!(decode(&last).unwrap().status, Status::Auth);
    assert!(!names_the_node(&raw), "{raw:?}");
    assert!(wait_until(|| r
        .stats()
        .unauthenticated
        .load(Ordering::Relaxed)
        == 2));
    assert!(reaches_rdma(&measure_member(addr)));
}

/// Before: a version-1 OTHER_GROUP from whoever held the address made the client skip the
/// peer (and the agent exclude it until restart). Now no unauthenticated answer is a skip:
/// OTHER_GROUP or SELF as a bare status, or in a WELCOME with a forged MAC, are `connect`
/// failures, and the peer is asked again next round.
#[test]
fn redteam_a_squatters_other_group_is_not_believed() {
    let squat = |frames: Vec<[u8; FRAME_LEN]>| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut open = [0u8; FRAME_LEN];
            let _ = s.read_exact(&mut open);
            for f in frames {
                let _ = s.write_all(&f);
                let mut hello = [0u8; FRAME_LEN];
                let _ = s.read_exact(&mut hello);
            }
        });
        measure_member(at)
    };
    let mut v1 = encode(T_WELCOME, Status::OtherGroup, &[]);
    v1[4..6].copy_from_slice(&1u16.to_be_bytes());
    let challenge = encode_challenge(&[1; 16], &keys().ids().next().unwrap());
    for frames in [
        vec![v1],
        vec![encode(T_CHALLENGE, Status::OtherGroup, &[])],
        vec![encode(T_CHALLENGE, Status::SelfNode, &[])],
        // A CHALLENGE naming the pool's key, without its MAC.
        vec![challenge],
    ] {
        match squat(frames) {
            Outcome::Failed {
                kind: Some(ErrorKind::Connect),
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }
}

/// The pool's key is everyone's, so the responder is held to what the Node
/// dialled publishes: its name (none is not a name), and its ENDPOINT to one of that Node's
/// ports (a RoCE GID, an InfiniBand LID); another node's HCA is refused.
#[test]
fn redteam_an_endpoint_is_pinned_to_the_dialled_nodes_ports() {
    let pin = Pin::new(
        "gpu-b",
        &[
            "mlx5_0/1=0000:0000:0000:0000:0000:ffff:0a00:0902".to_owned(),
            "mlx5_1/1=lid:17".to_owned(),
            "mlx5_2/1=garbage".to_owned(),
            "no-equals".to_owned(),
        ],
    );
    let b = parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0902").unwrap();
    let other = parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0903").unwrap();
    assert!(pin.admits(b, 0, true));
    assert!(!pin.admits(other, 0, true), "another node's GID");
    assert!(pin.admits([0; 16], 17, false));
    assert!(!pin.admits([0; 16], 18, false), "another node's LID");
    assert!(!pin.admits([0; 16], 0, false), "no LID at all");
    assert_eq!(
        (pin.gids.len(), pin.lids.len()),
        (1, 1),
        "malformed entries dropped"
    );
    for bad in [
        "",
        "fe80::1",
        "fe80:0000:0000:0000:0000:0000:0000",
        "zzzz:0000:0000:0000:0000:0000:0000:0000",
    ] {
        assert_eq!(parse_gid(bad), None, "{bad}");
    }
    // A responder of the pool that answers as no node, or as another, is refused before any
    // RDMA (this machine has none: without the pin the client reaches its verbs step).
    for name in ["", "gpu-c"] {
        let r = responder(Identity {
            node_name: name.into(),
            group: "pool-1".into(),
        });
        r.set_ports(vec![local()]);
        let unpinned = measure_member(r.local_addr());
        assert!(reaches_rdma(&unpinned), "{unpinned:?}");
        let o = measure_pinned(
            None,
            r.local_addr(),
            &local(),
            &member(),
            &keys(),
            &Plan::default(),
            Duration::from_secs(5),
            Some(&pin),
        );
        match o {
            Outcome::Failed {
                kind: Some(ErrorKind::Verification),
                message,
            } => assert!(
                message.contains(&format!(
                    "answered as {}, not as node gpu-b",
                    answered_as(name)
                )),
                "{message}"
            ),
            o => panic!("{o:?}"),
        }
    }
}

/// The responder attests its end of a pair. A session that names a gang
/// check in its HELLO leaves a receipt: who (the authenticated HELLO's node), on which port,
/// and what arrived (a greeting, verified bytes, or the failure); one naming no check, none.
#[test]
fn redteam_the_responder_keeps_receipts_of_a_checks_sessions() {
    let r = victim();
    let receipts = r.receipts();
    let uid = "0f1e2d3c-aaaa-bbbb-cccc-000000000001";
    let mut pin = Pin::new("gpu-a", &[]);
    pin.tag = CheckTag::new(uid, 0, 1).unwrap();
    let port = local();
    let pinned = GreetOptions {
        local: Some(&port),
        pin: Some(&pin),
        timeout: Duration::from_secs(5),
        ..GreetOptions::default()
    };
    let g = greet(r.local_addr(), &member(), &keys(), &pinned);
    assert!(g.is_ok(), "{g:?}");
    // Over RDMA: this machine has none, so both sides stop at their verbs step: the receipt
    // is a failure, not bytes.
    let o = measure_pinned(
        None,
        r.local_addr(),
        &local(),
        &member(),
        &keys(),
        &Plan::default(),
        Duration::from_secs(5),
        Some(&pin),
    );
    assert!(reaches_rdma(&o), "{o:?}");
    // A session for no check leaves nothing.
    let unpinned = GreetOptions {
        pin: None,
        ..pinned
    };
    assert!(greet(r.local_addr(), &member(), &keys(), &unpinned).is_ok());
    assert!(wait_until(|| receipts.of(uid, "gpu-b").len() == 2));
    let got = receipts.of(uid, "gpu-b");
    assert_eq!(got[0].seen, Seen::Greeted);
    assert_eq!((got[0].device.as_str(), got[0].port), ("rxe0", 1));
    assert!(matches!(&got[1].seen, Seen::Failed(_)), "{got:?}");
    assert!(receipts.of(uid, "gpu-c").is_empty(), "only gpu-b's");
    assert!(
        receipts
            .of("0f1e2d3c-aaaa-bbbb-cccc-000000000002", "gpu-b")
            .is_empty()
    );
    assert_eq!(CheckTag::new("not a uid", 0, 1), None);
}
