//! "The webhook can be held open": 3,000 idle TLS connections and 1,000 slowloris
//! connections were never closed at 35f8061 (descriptors and memory grew toward the pod's
//! 128Mi limit). Replayed over real TLS on 127.0.0.1; what the server holds is read from
//! /proc/net/tcp (sockets on the server's port that still have a descriptor).

use super::common::tls::TestPki;
use super::{Server, cfg, https, start_with};
use fabricgate::observe::server::Limits;
use fabricgate::pod::webhook::ServerConfig;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// One flood at a time: each needs the CPU to itself to say anything about timing.
static FLOOD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sockets whose local port is `port` (the server's side) that a descriptor still holds.
fn held(port: u16) -> usize {
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let local_port = local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            // 0A: LISTEN; inode 0: no descriptor left (closed, in FIN_WAIT or TIME_WAIT).
            if local_port == Some(port) && *state != "0A" && *inode != "0" {
                n += 1;
            }
        }
    }
    n
}

fn enough_descriptors(needed: u64) -> bool {
    let nofile = fabricgate::observe::server::raise_nofile();
    super::common::require(
        nofile.soft.is_none_or(|s| s >= needed),
        &format!("an open-file limit of at least {needed}"),
        "ulimit -n 20000",
    )
}

async fn server(pki: &TestPki, limits: Limits) -> Server {
    start_with(ServerConfig {
        limits,
        ..ServerConfig::new(cfg(), pki.cert_file.clone(), pki.key_file.clone())
    })
    .await
}

/// Whether the server closed `tls` within `limit` (EOF or an error; data is read past).
async fn closed_within(mut tls: Tls, limit: Duration) -> bool {
    let mut buf = [0u8; 512];
    let read = async {
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(limit, read).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redteam_3000_idle_tls_connections_are_capped_and_closed() {
    if !enough_descriptors(8000) {
        return;
    }
    let _one = FLOOD.lock().await;
    const CAP: usize = 64;
    const IDLE: usize = 3000;
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let limits = Limits {
        max_connections: CAP,
        header_read_timeout: Duration::from_secs(2),
        ..ServerConfig::default_limits(CAP, None)
    };
    let mut server = server(&pki, limits).await;
    let port = server.addr.port();

    // Connect, finish the TLS handshake, send nothing; 100 at a time.
    let mut idle: Vec<Tls> = Vec::new();
    let mut peak = 0;
    let started = Instant::now();
    while idle.len() < IDLE && started.elapsed() < Duration::from_secs(120) {
        let batch: Vec<_> = (0..100)
            .map(|_| {
                let pki_config = pki.client_config();
                let addr = server.addr;
                tokio::spawn(async move {
                    let connector = tokio_rustls::TlsConnector::from(pki_config);
                    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
                    let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
                    connector.connect(name, tcp).await.ok()
                })
            })
            .collect();
        for t in batch {
            if let Ok(Some(tls)) = t.await {
                idle.push(tls);
            }
        }
        peak = peak.max(held(port));
    }
    let opened = idle.len();
    eprintln!(
        "{opened} idle TLS connections opened in {:.1}s; the server held at most {peak}",
        started.elapsed().as_secs_f64()
    );
    assert!(opened >= IDLE / 2, "only {opened} handshakes completed");
    assert!(
        peak <= CAP + 16,
        "the server held {peak} connections, cap {CAP}"
    );

    // The API server still gets an answer: the oldest idle connection makes room.
    let (_, status, body) = https(&pki, server.addr, "GET", "/healthz", b"").await;
    assert_eq!((status, body.as_str()), (200, "ok"));

    // And every idle one is closed: evicted, or after the header-read timeout.
    let closing: Vec<_> = idle
        .into_iter()
        .map(|tls| tokio::spawn(closed_within(tls, Duration::from_secs(6))))
        .collect();
    let mut open = 0;
    for c in closing {
        if !c.await.unwrap() {
            open += 1;
        }
    }
    assert_eq!(open, 0, "{open} idle connections were never closed");
    assert_eq!(held(port), 0, "the server holds no socket of them");
    server.stop.take().unwrap().send(()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redteam_1000_slowloris_connections_are_closed_at_the_header_timeout() {
    if !enough_descriptors(4000) {
        return;
    }
    let _one = FLOOD.lock().await;
    const SLOW: usize = 1000;
    let timeout = Duration::from_secs(2);
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    // A cap above the attack: the header-read timeout alone must close them.
    let limits = Limits {
        header_read_timeout: timeout,
        ..ServerConfig::default_limits(4096, None)
    };
    let mut server = server(&pki, limits).await;
    let port = server.addr.port();

    // Each sends a request head one byte every 300 ms, and reports when the server closed
    // it (after its TLS handshake: the clients' own handshakes queue on a loaded machine), or
    // None if it was still open 15 s after.
    let started = Instant::now();
    let handshaken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let slow: Vec<_> = (0..SLOW)
        .map(|_| {
            let pki_config = pki.client_config();
            let addr = server.addr;
            let handshaken = std::sync::Arc::clone(&handshaken);
            tokio::spawn(async move {
                let _count = Counted(handshaken);
                let connector = tokio_rustls::TlsConnector::from(pki_config);
                let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
                let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
                let tls = connector.connect(name, tcp).await;
                drop(_count);
                let Ok(tls) = tls else {
                    return Some(Duration::ZERO); // closed during the handshake
                };
                let begun = Instant::now();
                let (mut rd, mut wr) = tokio::io::split(tls);
                let head = b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nX-Slow: ";
                if wr.write_all(&head[..20]).await.is_err() {
                    return Some(begun.elapsed());
                }
                let mut buf = [0u8; 256];
                let mut tick = tokio::time::interval(Duration::from_millis(300));
                while begun.elapsed() < Duration::from_secs(15) {
                    tokio::select! {
                        r = rd.read(&mut buf) => match r {
                            Ok(0) | Err(_) => return Some(begun.elapsed()),
                            Ok(_) => {}
                        },
                        _ = tick.tick() => {
                            if wr.write_all(b"a").await.is_err() {
                                return Some(begun.elapsed());
                            }
                        }
                    }
                }
                None
            })
        })
        .collect();
    // Once the handshakes are over (they queue for the CPU), the dribbling clients cost the
    // server next to nothing: a request is served meanwhile.
    while handshaken.load(std::sync::atomic::Ordering::Acquire) < SLOW
        && started.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = held(port);
    let (_, status, _) = https(&pki, server.addr, "GET", "/healthz", b"").await;
    assert_eq!(status, 200);

    let mut latest = Duration::ZERO;
    let mut never = 0;
    for s in slow {
        match s.await.unwrap() {
            Some(after) => latest = latest.max(after),
            None => never += 1,
        }
    }
    eprintln!(
        "{SLOW} slowloris connections: {during} held after the handshakes, all closed {:.1}s after \
         their handshake at the latest ({:.1}s in all)",
        latest.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        never, 0,
        "{never} slowloris connections were still open after 15 s"
    );
    assert!(
        latest < timeout + Duration::from_secs(6),
        "closed {latest:?} after the handshake; header-read timeout {timeout:?}"
    );
    assert_eq!(held(port), 0);
    server.stop.take().unwrap().send(()).unwrap();
}

/// Counts one client past its handshake (or its failure, or its end) when dropped.
struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
}
