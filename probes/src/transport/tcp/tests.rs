//! The sock_diag parser over replies captured on the build host (`tests/fixtures/sockdiag/`,
//! written by `a_live_dump_sees_its_own_connection` with `FG_CAPTURE_SOCKDIAG=<dir>`: a
//! loopback connection that moved 100,000 bytes one way and 1,000 back: the kernel counted
//! the client's as 100,001 acked), and the live dump.

use super::*;
use std::io::{Read, Write};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/sockdiag/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_captured_dump_has_the_connection_and_its_bytes() {
    let reply: Vec<Vec<u8>> = (0..4)
        .map(|i| fixture(&format!("tcp4-{i:02}.bin")))
        .collect();
    let sockets = parse_dump(&reply).unwrap();
    let port: u16 = String::from_utf8(fixture("port.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let client = sockets
        .iter()
        .find(|s| s.remote.port() == port)
        .expect("the client's socket");
    assert_eq!(client.remote.ip().to_string(), "127.0.0.1");
    assert_eq!(client.state, 1, "ESTABLISHED");
    let server = sockets.iter().find(|s| s.local.port() == port).unwrap();
    assert_eq!(
        (client.bytes_acked, client.bytes_received),
        (Some(100_001), Some(1_000)),
        "{client:?}"
    );
    assert_eq!(
        (server.bytes_acked, server.bytes_received),
        (Some(1_000), Some(100_000)),
        "{server:?}"
    );
    assert_ne!(client.cookie, server.cookie);
}

#[test]
fn a_reply_cut_short_is_an_error_never_a_panic() {
    let whole = fixture("tcp4-00.bin");
    for cut in [1, 15, 16, 40, whole.len() / 2, whole.len() - 1] {
        let e = parse_dump(&[&whole[..cut]]).unwrap_err();
        assert!(matches!(e, ProbeError::Netlink { .. }), "{cut}: {e}");
    }
    // Whole messages without the final NLMSG_DONE: cut short too.
    let e = parse_dump(&[whole]).unwrap_err();
    assert!(e.to_string().contains("without NLMSG_DONE"), "{e}");
}

#[test]
fn the_kernels_refusal_is_its_errno() {
    // NLMSG_DONE carrying -EINVAL, as a dump whose start failed ends.
    let mut done = vec![20, 0, 0, 0, 3, 0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0];
    done.extend((-22i32).to_ne_bytes());
    let e = parse_dump(&[done.clone()]).unwrap_err();
    assert!(e.to_string().contains("Invalid argument"), "{e}");
    // -ENOENT: no tcp_diag in the kernel (the Soft-RoCE VM before it loads the module).
    done[16..20].copy_from_slice(&(-2i32).to_ne_bytes());
    let e = parse_dump(&[done]).unwrap_err();
    assert!(e.to_string().contains("modprobe tcp_diag"), "{e}");
}

#[test]
fn the_request_is_an_inet_diag_req_v2_for_tcp_with_tcp_info() {
    let r = dump_request(AF_INET, 7);
    assert_eq!(r.len(), 16 + 56);
    assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 20, "SOCK_DIAG_BY_FAMILY");
    assert_eq!(u16::from_ne_bytes([r[6], r[7]]), NLM_F_REQUEST | NLM_F_DUMP);
    assert_eq!(u32::from_ne_bytes([r[8], r[9], r[10], r[11]]), 7);
    assert_eq!(&r[16..19], &[AF_INET, IPPROTO_TCP, 1 << 1]);
}

/// A real loopback connection in this namespace: the live dump lists it with its bytes.
#[test]
fn a_live_dump_sees_its_own_connection() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut server, _) = listener.accept().unwrap();
    client.write_all(&[7u8; 100_000]).unwrap();
    let mut got = vec![0u8; 100_000];
    server.read_exact(&mut got).unwrap();
    server.write_all(&[1u8; 1_000]).unwrap();
    let mut back = vec![0u8; 1_000];
    client.read_exact(&mut back).unwrap();
    let Ok(mut socket) = open() else {
        eprintln!("no sock_diag here: the live half is not tested");
        return;
    };
    // The last ACK may still be on its way: ask until it is counted.
    let mut reply = Vec::new();
    for _ in 0..50 {
        reply = NetlinkDump::dump(&mut socket, &dump_request(AF_INET, 1)).unwrap();
        let sockets = parse_dump(&reply).unwrap();
        let mine = sockets.iter().find(|s| s.remote.port() == port).unwrap();
        if mine.bytes_acked >= Some(100_000) && mine.bytes_received >= Some(1_000) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let sockets = parse_dump(&reply).unwrap();
    let mine = sockets.iter().find(|s| s.remote.port() == port).unwrap();
    // The kernel's tcpi_bytes_acked may count one more than the data (the connecting side's
    // first ACK, as captured: 100,001).
    let bytes = mine.bytes().unwrap();
    assert!((101_000..=101_002).contains(&bytes), "{mine:?}");
    // Both families through one socket.
    let both = read_sockets(&mut socket).unwrap();
    assert!(both.iter().any(|s| s.remote.port() == port));
    if let Ok(dir) = std::env::var("FG_CAPTURE_SOCKDIAG") {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, d) in reply.iter().enumerate() {
            std::fs::write(format!("{dir}/tcp4-{i:02}.bin"), d).unwrap();
        }
        std::fs::write(format!("{dir}/port.txt"), format!("{port}\n")).unwrap();
    }
}

/// A pod that opens loopback sockets by the hundred thousand (no capability needed) made the
/// agent buffer, parse, clone and keep every one each window: OOM-killed past its limit. Now the
/// live dump counts at most `max` sockets of a namespace (past it an error naming `max`, the
/// rest of the answer unread) and keeps none to a loopback address. Here 600 loopback
/// connections (1,200 sockets) in this namespace.
#[test]
fn redteam_a_namespace_of_loopback_sockets_is_counted_to_the_cap_and_never_kept() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut held = Vec::new();
    for _ in 0..600 {
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        held.push((client, server));
    }
    let Ok(mut socket) = open() else {
        eprintln!("no sock_diag here: the live half is not tested");
        return;
    };
    let e = read_sockets_bounded(&mut socket, 500).unwrap_err();
    assert!(e.to_string().contains("more than 500 TCP sockets"), "{e}");
    let mut socket = open().unwrap();
    let kept = read_sockets_bounded(&mut socket, 10_000_000).unwrap();
    assert!(
        kept.iter().all(|s| !s.remote.ip().is_loopback()),
        "loopback sockets kept: {}",
        kept.iter().filter(|s| s.remote.ip().is_loopback()).count()
    );
    // The unbounded read still sees them all (what `check` without a cap would hold).
    let mut socket = open().unwrap();
    let all = read_sockets(&mut socket).unwrap();
    let ours = all
        .iter()
        .filter(|s| s.remote.port() == port || s.local.port() == port)
        .count();
    assert_eq!(ours, 1_200);
    drop(held);
}
