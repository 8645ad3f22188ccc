use super::wire::*;
use super::*;
use crate::rdma::verbs::rc::EndpointInfo;
use crate::rdma::{Gid, PhysState, PortState, VerbsDevice};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Attacks on the responder and the client, each a redteam_ test.
mod redteam;

#[test]
fn frames_round_trip_and_garbage_is_rejected() {
    let hello = Hello {
        identity: Identity {
            node_name: "gpu-a".into(),
            group: "rail-3".into(),
        },
        device: "mlx5_3".into(),
        port: 1,
        plan: Plan {
            rtt_size: 64,
            rtt_count: 16,
            bw_size: 65536,
            bw_duration: Duration::from_millis(100),
        },
        tag: super::CheckTag {
            check: [7; 16],
            rail: 2,
            rails: 8,
        },
        greet: true,
    };
    let f = decode(&hello.encode()).unwrap();
    assert_eq!(f.version, PROTOCOL_VERSION);
    assert_eq!(f.kind, T_HELLO);
    assert_eq!(Hello::decode(&f.payload), hello);
    let e = EndpointInfo {
        gid: [7; 16],
        qpn: 0x12_3456,
        psn: 0xab_cdef,
        lid: 9,
        mtu: 1024,
        addr: 0xdead_beef_0000,
        rkey: 0x4242,
        len: 2048,
    };
    let f = decode(&encode_endpoint(&e, Status::Ok)).unwrap();
    assert_eq!(decode_endpoint(&f.payload), e);
    let mut junk = [0xffu8; FRAME_LEN];
    assert_eq!(decode(&junk), None);
    junk[..4].copy_from_slice(b"FGPR");
    let f = decode(&junk).unwrap();
    assert_eq!(f.status, Status::Unknown(255));
    // Non-ASCII names on the wire are dropped, not passed on.
    let h = Hello::decode(&f.payload);
    assert_eq!(h.identity.node_name, "");
}

#[test]
fn plans_outside_the_limits_are_refused() {
    assert!(Plan::default().validate().is_ok());
    let big = Plan {
        rtt_size: MAX_RTT_SIZE,
        rtt_count: MAX_RTT_COUNT,
        bw_size: MAX_BW_SIZE,
        bw_duration: MAX_BW_DURATION,
    };
    assert!(big.validate().is_ok());
    assert_eq!(big.buffer_len(), MAX_BUFFER);
    for bad in [
        Plan {
            rtt_size: MAX_RTT_SIZE + 1,
            ..Plan::default()
        },
        Plan {
            rtt_size: 1,
            ..Plan::default()
        },
        Plan {
            rtt_count: 0,
            ..Plan::default()
        },
        Plan {
            rtt_count: MAX_RTT_COUNT + 1,
            ..Plan::default()
        },
        Plan {
            bw_size: MAX_BW_SIZE + 1,
            ..Plan::default()
        },
        Plan {
            bw_size: 65536,
            bw_duration: Duration::from_secs(3),
            ..Plan::default()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

#[test]
fn percentiles_use_nearest_rank() {
    let d: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
    assert_eq!(percentile(&d, 0.0), Duration::from_micros(1));
    assert_eq!(percentile(&d, 0.5), Duration::from_micros(5));
    assert_eq!(percentile(&d, 0.99), Duration::from_micros(10));
    assert_eq!(percentile(&d, 1.0), Duration::from_micros(10));
    assert_eq!(percentile(&[], 0.5), Duration::ZERO);
}

#[test]
fn patterns_differ_between_sessions_and_digests_see_it() {
    let a = pattern(1, 1000);
    let b = pattern(2, 1000);
    assert_eq!(a.len(), 1000);
    assert_ne!(a, b);
    assert_ne!(digest(&a), digest(&b));
    assert_eq!(digest(&a), digest(&pattern(1, 1000)));
}

fn port(n: u32, up: bool, ll: LinkLayer, gids: Vec<Gid>) -> PortReport {
    PortReport {
        port: n,
        state: Some(if up {
            PortState::Active
        } else {
            PortState::Down
        }),
        phys_state: Some(if up {
            PhysState::LinkUp
        } else {
            PhysState::Disabled
        }),
        link_layer: Some(ll),
        gids,
        ..PortReport::default()
    }
}

#[test]
fn usable_ports_are_up_opened_matching_and_addressable() {
    let v2 = |i, g: &str| Gid {
        index: i,
        gid: g.into(),
        gid_type: Some(GidType::RoceV2),
        netdev: Some("eth0".into()),
    };
    let report = RdmaReport {
        devices: vec![
            DeviceReport {
                name: "rxe0".into(),
                ports: vec![port(
                    1,
                    true,
                    LinkLayer::Ethernet,
                    vec![
                        v2(0, "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
                        v2(1, "0000:0000:0000:0000:0000:ffff:a9fe:4d01"),
                    ],
                )],
                verbs: Some(VerbsDevice {
                    opened: true,
                    ..VerbsDevice::default()
                }),
                ..DeviceReport::default()
            },
            DeviceReport {
                name: "mlx5_0".into(),
                ports: vec![
                    port(1, true, LinkLayer::InfiniBand, vec![]),
                    port(2, false, LinkLayer::InfiniBand, vec![]),
                ],
                ..DeviceReport::default()
            },
            DeviceReport {
                name: "mlx5_1".into(),
                ports: vec![port(1, true, LinkLayer::Ethernet, vec![])],
                ..DeviceReport::default()
            },
            DeviceReport {
                name: "mlx5_2".into(),
                ports: vec![port(1, true, LinkLayer::InfiniBand, vec![])],
                verbs: Some(VerbsDevice::default()),
                ..DeviceReport::default()
            },
        ],
        ..RdmaReport::default()
    };
    let all = LocalPort::usable(&report, &|_| true);
    assert_eq!(
        all,
        vec![
            LocalPort {
                device: "rxe0".into(),
                port: 1,
                gid_index: Some(1)
            },
            LocalPort {
                device: "mlx5_0".into(),
                port: 1,
                gid_index: None
            },
        ]
    );
    let rxe = LocalPort::usable(&report, &|d| d.starts_with("rxe"));
    assert_eq!(rxe.len(), 1);
}

/// The pool's key in these tests.
pub(super) fn keys() -> Keys {
    Keys::from_secrets(&[b"0123456789abcdef0123456789abcdef"])
}

pub(super) fn responder(identity: Identity) -> Responder {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ring = std::sync::Arc::new(KeyRing::fixed(keys()));
    let r = Responder::start(l, identity, ring, Roots::default(), SESSION_LIMIT).unwrap();
    r.set_ports(Vec::new());
    r
}

pub(super) fn local() -> LocalPort {
    LocalPort {
        device: "rxe0".into(),
        port: 1,
        gid_index: Some(1),
    }
}

#[test]
fn responder_refuses_self_other_groups_and_portless_sessions() {
    let r = responder(Identity {
        node_name: "gpu-a".into(),
        group: "pool-1".into(),
    });
    let me = |name: &str, group: &str| Identity {
        node_name: name.into(),
        group: group.into(),
    };
    let t = Duration::from_secs(5);
    let plan = Plan::default();
    let addr = r.local_addr();
    assert_eq!(
        measure(addr, &local(), &me("gpu-a", "pool-1"), &keys(), &plan, t),
        Outcome::Skipped(Skip::SelfNode)
    );
    assert_eq!(
        measure(addr, &local(), &me("gpu-b", "pool-2"), &keys(), &plan, t),
        Outcome::Skipped(Skip::OtherGroup)
    );
    // No validated port on the responder: a connect-kind failure that says so.
    match measure(addr, &local(), &me("gpu-b", "pool-1"), &keys(), &plan, t) {
        Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            message,
        } => assert!(message.contains("no usable RDMA port"), "{message}"),
        other => panic!("{other:?}"),
    }
    // Counted when the session thread ends, which may be just after our reply.
    assert!(wait_until(|| r.stats().refused.load(Ordering::Relaxed) == 3));
}

pub(super) fn wait_until(cond: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn unreachable_and_silent_peers_fail_with_their_kind_in_time() {
    // Nothing listens: connect.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let t = Duration::from_secs(2);
    let started = Instant::now();
    match measure(
        dead,
        &local(),
        &Identity::default(),
        &keys(),
        &Plan::default(),
        t,
    ) {
        Outcome::Failed { kind, .. } => assert_eq!(kind, Some(ErrorKind::Connect)),
        other => panic!("{other:?}"),
    }
    // A listener that accepts and never answers: timeout, within the bound.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
    let t = Duration::from_millis(700);
    let started2 = Instant::now();
    match measure(
        addr,
        &local(),
        &Identity::default(),
        &keys(),
        &Plan::default(),
        t,
    ) {
        Outcome::Failed { kind, .. } => assert_eq!(kind, Some(ErrorKind::Timeout)),
        other => panic!("{other:?}"),
    }
    assert!(started2.elapsed() < Duration::from_secs(3));
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(hold.join());
}

/// A stranger: garbage, a frame that never completes, a flood of connections. The
/// responder stays bounded and keeps serving well-formed clients.
#[test]
fn responder_survives_garbage_and_bounds_concurrent_sessions() {
    let r = responder(Identity {
        node_name: "gpu-a".into(),
        group: String::new(),
    });
    let addr = r.local_addr();
    let mut junk = TcpStream::connect(addr).unwrap();
    junk.write_all(&[0x42; FRAME_LEN]).unwrap();
    let mut buf = [0u8; 16];
    junk.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(junk.read(&mut buf).unwrap_or(0), 0, "garbage is dropped");
    assert!(wait_until(|| r.pending_handshakes() == 0));

    // Hold MAX_HANDSHAKES half-open connections, MAX_HANDSHAKES_PER_SOURCE from each
    // address: the next one is told BUSY at once; no session slot is taken.
    let holders: Vec<TcpStream> = (0..MAX_HANDSHAKES)
        .map(|i| {
            let src = 10 + (i / MAX_HANDSHAKES_PER_SOURCE) as u8;
            let mut s = connect_from([127, 0, 0, src], addr);
            s.write_all(&[b'F'; 10]).unwrap();
            s
        })
        .collect();
    assert!(wait_until(|| r.pending_handshakes() == MAX_HANDSHAKES));
    assert_eq!(r.active_sessions(), 0);
    let mut extra = TcpStream::connect(addr).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut f = [0u8; FRAME_LEN];
    extra.read_exact(&mut f).unwrap();
    let frame = decode(&f).unwrap();
    assert_eq!(frame.kind, T_CHALLENGE);
    assert_eq!(frame.status, Status::Busy);
    // The half-open connections are cut after HANDSHAKE_TIMEOUT; then a client is served
    // again (here: refused as SELF, which needs a free place).
    drop(holders);
    assert!(wait_until(|| r.pending_handshakes() == 0));
    let me = Identity {
        node_name: "gpu-a".into(),
        group: String::new(),
    };
    assert_eq!(
        measure(
            addr,
            &local(),
            &me,
            &keys(),
            &Plan::default(),
            FRAME_TIMEOUT
        ),
        Outcome::Skipped(Skip::SelfNode)
    );
}

#[test]
fn a_responder_before_its_first_probe_says_starting() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ring = std::sync::Arc::new(KeyRing::fixed(keys()));
    let r = Responder::start(
        l,
        Identity::default(),
        ring,
        Roots::default(),
        SESSION_LIMIT,
    )
    .unwrap();
    let me = Identity {
        node_name: "gpu-b".into(),
        group: String::new(),
    };
    let t = Duration::from_secs(5);
    assert_eq!(
        measure(r.local_addr(), &local(), &me, &keys(), &Plan::default(), t),
        Outcome::Skipped(Skip::Starting)
    );
    r.set_ports(Vec::new());
    assert!(matches!(
        measure(r.local_addr(), &local(), &me, &keys(), &Plan::default(), t),
        Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            ..
        }
    ));
}

/// A client of another version (here: a version-1 HELLO) learns the responder's version and
/// nothing else: no node name, no group.
#[test]
fn version_mismatch_is_refused_with_the_responders_version_only() {
    let r = responder(Identity {
        node_name: "gpu-a".into(),
        group: "pool-1".into(),
    });
    let mut s = TcpStream::connect(r.local_addr()).unwrap();
    let mut hello = Hello {
        identity: Identity::default(),
        device: "rxe0".into(),
        port: 1,
        plan: Plan::default(),
        tag: super::CheckTag::default(),
        greet: false,
    }
    .encode();
    hello[4..6].copy_from_slice(&1u16.to_be_bytes());
    s.write_all(&hello).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut f = [0u8; FRAME_LEN];
    s.read_exact(&mut f).unwrap();
    let frame = decode(&f).unwrap();
    assert_eq!(frame.status, Status::Version);
    assert_eq!(frame.version, PROTOCOL_VERSION);
    assert!(
        f[8..].iter().all(|&b| b == 0),
        "nothing but the version: {f:?}"
    );
}

/// A TCP connection from the local address `src` (any of 127/8 on Linux's loopback).
pub(super) fn connect_from(src: [u8; 4], dst: std::net::SocketAddr) -> TcpStream {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &std::net::SocketAddrV4::new(src.into(), 0)).unwrap();
    let std::net::SocketAddr::V4(dst) = dst else {
        panic!("IPv4 only")
    };
    connect(&fd, &dst).unwrap();
    TcpStream::from(fd)
}

#[test]
fn key_files_parse_hex_keys_and_never_quote_them() {
    let k = Keys::parse("# pool key\n00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n\n00112233445566778899aabbccddeeff\n").unwrap();
    assert_eq!(k.len(), 2);
    for (bad, says) in [
        ("", "no key"),
        ("# only a comment\n", "no key"),
        ("0011", "too short"),
        ("zz112233445566778899aabbccddeeff", "not a key"),
        (&"00112233445566778899aabbccddeeff\n".repeat(5), "at most 4"),
    ] {
        let e = Keys::parse(bad).unwrap_err();
        assert!(e.contains(says), "{bad:?}: {e}");
        assert!(!e.contains("2233"), "the error quotes the key: {e}");
    }
    assert!(!format!("{k:?}").contains("2233"));
    let dir = tempfile::tempdir().unwrap();
    let e = KeyRing::load(&dir.path().join("key"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("key") && e.contains("cannot open"), "{e}");
}

/// A Secret volume updates by swapping the `..data` symlink: the responder re-reads the key
/// file by path, accepts both keys while the file holds both, and drops the old one when it
/// leaves the file, without a restart.
#[test]
fn key_rotation_through_a_secret_volume_swap_needs_no_restart() {
    use std::os::unix::fs::symlink;
    let old = "11111111111111111111111111111111";
    let new = "22222222222222222222222222222222";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let version = |name: &str, text: &str| {
        std::fs::create_dir(d.join(name)).unwrap();
        std::fs::write(d.join(name).join("key"), text).unwrap();
        let tmp = d.join("..data_tmp");
        symlink(name, &tmp).unwrap();
        std::fs::rename(&tmp, d.join("..data")).unwrap();
    };
    version("..v1", old);
    symlink("..data/key", d.join("key")).unwrap();
    let ring = std::sync::Arc::new(KeyRing::load(&d.join("key")).unwrap());
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let r = Responder::start(
        l,
        Identity::default(),
        std::sync::Arc::clone(&ring),
        Roots::default(),
        SESSION_LIMIT,
    )
    .unwrap();
    r.set_ports(Vec::new());
    let with = |key: &str| {
        let k = Keys::parse(key).unwrap();
        let me = Identity {
            node_name: "gpu-b".into(),
            group: String::new(),
        };
        match measure(
            r.local_addr(),
            &local(),
            &me,
            &k,
            &Plan::default(),
            FRAME_TIMEOUT,
        ) {
            // Authenticated: refused only for having no port.
            Outcome::Failed { message, .. } if message.contains("no usable RDMA port") => true,
            Outcome::Failed { message, .. } if message.contains("authentication") => false,
            other => panic!("{other:?}"),
        }
    };
    assert!(with(old));
    assert!(!with(new));
    version("..v2", &format!("{new}\n{old}\n"));
    std::thread::sleep(auth::KEY_RELOAD + Duration::from_millis(100));
    assert!(with(new), "the new key is accepted after the swap");
    assert!(with(old), "the old key still is, during the rotation");
    assert_eq!(ring.generation(), 1);
    version("..v3", new);
    std::thread::sleep(auth::KEY_RELOAD + Duration::from_millis(100));
    assert!(!with(old), "the old key is refused once it left the file");
    assert!(with(new));
    // A broken file keeps the keys in use, and says so once.
    std::fs::remove_file(d.join("..v3/key")).unwrap();
    std::thread::sleep(auth::KEY_RELOAD + Duration::from_millis(100));
    assert!(with(new));
    assert!(
        ring.take_reload_error()
            .is_some_and(|e| e.contains("still using"))
    );
}

/// `greet`: the side-channel half alone. A responder with a port welcomes a client of the
/// pool (naming itself and the port it would serve), refuses the wrong key, and answers
/// NO_PORT, SELF and nothing at all as `measure` does.
#[test]
fn greet_proves_the_side_channel_without_rdma() {
    let r = responder(Identity {
        node_name: "gpu-a".into(),
        group: String::new(),
    });
    let me = Identity {
        node_name: "gpu-b".into(),
        group: String::new(),
    };
    let t = Duration::from_secs(5);
    let addr = r.local_addr();
    let port = local();
    let opts = GreetOptions {
        local: Some(&port),
        timeout: t,
        ..GreetOptions::default()
    };
    match greet(addr, &me, &keys(), &opts) {
        Err(Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            message,
        }) => assert!(message.contains("no usable RDMA port"), "{message}"),
        other => panic!("{other:?}"),
    }
    r.set_ports(vec![local()]);
    let g = greet(addr, &me, &keys(), &opts).expect("welcomed");
    assert_eq!(
        (g.peer_node.as_str(), g.peer_device.as_str(), g.peer_port),
        ("gpu-a", "rxe0", 1)
    );
    assert!(g.elapsed < t);
    let stranger = Keys::from_secrets(&[b"ffffffffffffffffffffffffffffffff"]);
    match greet(addr, &me, &stranger, &opts) {
        Err(Outcome::Failed {
            kind: Some(ErrorKind::Connect),
            message,
        }) => assert!(message.contains("no peers key in common"), "{message}"),
        other => panic!("{other:?}"),
    }
    let self_node = Identity {
        node_name: "gpu-a".into(),
        group: String::new(),
    };
    assert_eq!(
        greet(addr, &self_node, &keys(), &opts),
        Err(Outcome::Skipped(Skip::SelfNode))
    );
    drop(r);
    assert!(
        matches!(
            greet(addr, &me, &keys(), &opts),
            Err(Outcome::Failed {
                kind: Some(ErrorKind::Connect),
                ..
            })
        ),
        "a responder that is gone"
    );
}
