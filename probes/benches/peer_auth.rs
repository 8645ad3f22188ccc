//! Cost of the peer channel's authentication: the HMAC-SHA256 work of one
//! session, and one authenticated side-channel exchange over loopback (OPEN, CHALLENGE,
//! HELLO, WELCOME: up to where the RDMA part would start) next to a refusal at CHALLENGE.
//!
//! `cargo bench -p fabricgate-probes --bench peer_auth`; figures in benches/README.md and
//! docs/hardening.md.

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::peer::auth::{Side, Transcript};
use fabricgate_probes::rdma::peer::{
    FRAME_LEN, Identity, KeyRing, Keys, LocalPort, Plan, Responder, measure,
};
use std::hint::black_box;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

fn keys() -> Keys {
    Keys::from_secrets(&[b"0123456789abcdef0123456789abcdef"])
}

fn bench(c: &mut Criterion) {
    let k = keys();
    // One session, both sides: the client seals 3 frames and verifies 4, the responder the
    // reverse.
    c.bench_function("peer_auth/session_macs_both_sides", |b| {
        let frame = [0x5au8; FRAME_LEN];
        b.iter(|| {
            let mut me = Transcript::for_bench(&k, [1; 16], [2; 16], Side::Client).unwrap();
            let mut other = Transcript::for_bench(&k, [1; 16], [2; 16], Side::Responder).unwrap();
            for _ in 0..3 {
                black_box(other.verify(&me.seal(frame)));
            }
            for _ in 0..4 {
                black_box(me.verify(&other.seal(frame)));
            }
        });
    });
    c.bench_function("peer_auth/key_file_parse", |b| {
        let text = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n\
                    ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100\n";
        b.iter(|| black_box(Keys::parse(black_box(text)).map(|k| k.len())));
    });

    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ring = Arc::new(KeyRing::fixed(keys()));
    let r = Responder::start(
        l,
        Identity::default(),
        ring,
        Roots::default(),
        Duration::from_secs(10),
    )
    .unwrap();
    // No port: every authenticated session ends at WELCOME NO_PORT.
    r.set_ports(Vec::new());
    let local = LocalPort {
        device: "rxe0".into(),
        port: 1,
        gid_index: Some(1),
    };
    let me = Identity {
        node_name: "bench".into(),
        group: String::new(),
    };
    let t = Duration::from_secs(5);
    c.bench_function("peer_auth/loopback_exchange_to_welcome", |b| {
        b.iter(|| {
            black_box(measure(
                r.local_addr(),
                &local,
                &me,
                &k,
                &Plan::default(),
                t,
            ))
        });
    });
    let stranger = Keys::from_secrets(&[b"another key of thirty-two bytes."]);
    c.bench_function("peer_auth/loopback_refused_at_challenge", |b| {
        b.iter(|| {
            black_box(measure(
                r.local_addr(),
                &local,
                &me,
                &stranger,
                &Plan::default(),
                t,
            ))
        });
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
