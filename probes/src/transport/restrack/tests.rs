//! The parsers over replies captured byte for byte in the Soft-RoCE VM
//! (`tests/vm/capture-restrack.sh`, `scripts/capture_rdma_restrack.py`): rxe0 with two
//! `ibv_rc_pingpong` (RC, RTS; the server in a kubepods cgroup), two `ibv_ud_pingpong` (UD)
//! and the kernel's GSI QP. `rdma-res-show-qp.txt` is what `rdma res show qp` printed right
//! after.

use super::*;

#[path = "../../../benches/support/restrack_synth.rs"]
mod synth;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/restrack/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn captured_qps() -> Vec<Vec<u8>> {
    vec![fixture("qp-0-00.bin"), fixture("qp-0-01.bin")]
}

#[test]
fn the_captured_device_dump_lists_rxe0() {
    let reply = [fixture("devices-00.bin"), fixture("devices-01.bin")];
    assert_eq!(
        parse_device_dump(&reply).unwrap(),
        vec![RdmaDevice {
            index: 0,
            name: "rxe0".into()
        }]
    );
}

#[test]
fn the_captured_qp_dump_is_what_rdma_res_show_qp_printed() {
    let qps = parse_qp_dump(&captured_qps()).unwrap();
    let qp = |lqpn, rqpn, qp_type, owner, pdn| QpEntry {
        device_index: 0,
        device: "rxe0".into(),
        port: Some(1),
        lqpn,
        rqpn,
        qp_type,
        state: QpState::Rts,
        owner,
        pdn,
    };
    assert_eq!(
        qps,
        vec![
            qp(17, Some(18), QpType::Rc, QpOwner::Pid(140), Some(1)),
            qp(18, Some(17), QpType::Rc, QpOwner::Pid(150), Some(2)),
            qp(19, None, QpType::Ud, QpOwner::Pid(162), Some(3)),
            qp(20, None, QpType::Ud, QpOwner::Pid(171), Some(4)),
            qp(
                1,
                None,
                QpType::Gsi,
                QpOwner::Kernel("ib_core".into()),
                None
            ),
        ]
    );
    // The same QPs, types, states and owners as the rdma tool's own listing.
    let text = String::from_utf8(fixture("rdma-res-show-qp.txt")).unwrap();
    for (line, qp) in text.lines().zip(&qps) {
        let word = |key: &str| {
            let mut it = line.split_whitespace();
            it.position(|w| w == key).and_then(|_| it.next())
        };
        assert_eq!(word("lqpn"), Some(qp.lqpn.to_string().as_str()), "{line}");
        assert_eq!(
            word("type"),
            Some(format!("{:?}", qp.qp_type).to_uppercase().as_str())
        );
        assert_eq!(word("state"), Some("RTS"));
        match &qp.owner {
            QpOwner::Pid(pid) => assert_eq!(word("pid"), Some(pid.to_string().as_str())),
            QpOwner::Kernel(name) => assert_eq!(word("comm"), Some(format!("[{name}]").as_str())),
            QpOwner::Hidden => panic!("{line}"),
        }
    }
}

#[test]
fn requests_are_what_the_capture_script_sent() {
    let req = qp_dump_request(2, 0);
    assert_eq!(
        req,
        [
            24, 0, 0, 0, 0x0a, 0x14, 0x05, 0x03, 2, 0, 0, 0, 0, 0, 0, 0, 8, 0, 1, 0, 0, 0, 0, 0
        ]
    );
    assert_eq!(
        device_dump_request(1),
        [16, 0, 0, 0, 0x01, 0x14, 0x05, 0x03, 1, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn a_reply_cut_short_is_an_error_never_a_short_list() {
    let whole = fixture("qp-0-00.bin");
    for cut in [3, 16, 40, whole.len() / 2, whole.len() - 1] {
        let err = parse_qp_dump(&[&whole[..cut]]).unwrap_err();
        assert!(
            matches!(&err, ProbeError::Netlink { message, .. } if message.starts_with("malformed reply")),
            "cut at {cut}: {err}"
        );
    }
    // Whole messages but no NLMSG_DONE: the rest of the dump was lost.
    let err = parse_qp_dump(&[&whole]).unwrap_err().to_string();
    assert!(err.contains("without NLMSG_DONE"), "{err}");
    assert!(parse_qp_dump::<&[u8]>(&[]).is_err());
}

#[test]
fn the_kernels_refusal_is_an_error_naming_the_errno() {
    // A QP dump without a device index: the kernel ends the dump at once with -EINVAL.
    let err = parse_qp_dump(&[fixture("qp-noindex-00.bin")]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("RDMA netlink QP dump: the kernel refused it"),
        "{text}"
    );
    assert!(text.contains("Invalid argument"), "{text}");
    assert_eq!(err.metric_label(), "parse");
    // An NLMSG_ERROR (e.g. EPERM) likewise.
    let mut error = fixture("qp-noindex-00.bin");
    error[4] = 2;
    error[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
    let text = parse_qp_dump(&[error]).unwrap_err().to_string();
    assert!(text.contains("Operation not permitted"), "{text}");
}

#[test]
fn ten_thousand_qps_over_many_messages() {
    let pids: Vec<u32> = (1000..1064).collect();
    let reply = synth::qp_dump(3, "mlx5_3", 10_000, &pids, 97);
    assert_eq!(
        reply.len(),
        10_000usize.div_ceil(97) + 1,
        "messages and NLMSG_DONE"
    );
    let qps = parse_qp_dump(&reply).unwrap();
    assert_eq!(qps.len(), 10_000);
    assert!(
        qps.iter()
            .all(|q| q.device == "mlx5_3" && q.qp_type == QpType::Rc)
    );
    assert_eq!(qps[0].lqpn, 17);
    assert_eq!(qps[9_999].lqpn, 10_016);
    assert!(matches!(qps[9_999].owner, QpOwner::Pid(p) if pids.contains(&p)));
}

struct Fake(Vec<io::Result<Vec<Vec<u8>>>>);

impl NetlinkDump for Fake {
    fn dump(&mut self, _request: &[u8]) -> io::Result<Vec<Vec<u8>>> {
        self.0.remove(0)
    }
}

#[test]
fn read_qps_dumps_devices_then_each_devices_qps() {
    let mut socket = Fake(vec![
        Ok(vec![fixture("devices-00.bin"), fixture("devices-01.bin")]),
        Ok(captured_qps()),
    ]);
    assert_eq!(read_qps(&mut socket).unwrap().len(), 5);
}

#[test]
fn no_rdma_netlink_at_all_is_its_own_error() {
    let mut socket = Fake(vec![Err(io::Error::from_raw_os_error(
        libc::EPROTONOSUPPORT,
    ))]);
    let err = read_qps(&mut socket).unwrap_err();
    assert!(
        matches!(err, ProbeError::RdmaNetlinkUnavailable { .. }),
        "{err}"
    );
    assert_eq!(err.metric_label(), "read");
    assert!(err.to_string().contains("ib_core is not loaded"), "{err}");
    let err = io_error(io::Error::from_raw_os_error(libc::ENOBUFS));
    assert!(matches!(err, ProbeError::Netlink { .. }), "{err}");
}

/// The port dumps captured in the VM in exclusive mode from the namespace that holds rxe0
/// (`tests/vm/capture-netns.sh`, `excl-pod-ports*`): `rdma link show` printed `link rxe0/1
/// state ACTIVE physical_state LINK_UP netdev eth0`, then, with eth0 down, `state DOWN
/// physical_state DISABLED`.
fn captured_ports(dir: &str) -> Vec<Vec<u8>> {
    vec![
        fixture(&format!("netns-exclusive/{dir}/ports-0-00.bin")),
        fixture(&format!("netns-exclusive/{dir}/ports-0-01.bin")),
    ]
}

#[test]
fn the_captured_port_dumps_are_what_rdma_link_show_printed() {
    let up = parse_port_dump(&captured_ports("hca-pod")).unwrap();
    assert_eq!(
        up,
        vec![NetlinkPort {
            device: "rxe0".into(),
            port: 1,
            state: Some(PortState::Active),
            physical_state: Some(PhysState::LinkUp),
            netdev: Some("eth0".into()),
        }]
    );
    assert!(up[0].is_active());
    let down = parse_port_dump(&captured_ports("hca-pod-down")).unwrap();
    assert_eq!(down[0].state, Some(PortState::Down));
    assert_eq!(down[0].physical_state, Some(PhysState::Disabled));
    assert!(!down[0].is_active());
}

#[test]
fn a_port_dump_cut_short_or_without_its_device_is_an_error_not_a_port() {
    let mut cut = captured_ports("hca-pod");
    cut.pop();
    let err = parse_port_dump(&cut).unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");
    let mut truncated = captured_ports("hca-pod");
    truncated[0].truncate(40);
    assert!(parse_port_dump(&truncated).is_err());
    // The same message with its device name attribute (kind 2) renamed to an unknown kind.
    let mut nameless = captured_ports("hca-pod");
    let at = 16 + 8;
    assert_eq!(&nameless[0][at + 2..at + 4], &2u16.to_ne_bytes());
    nameless[0][at + 2..at + 4].copy_from_slice(&999u16.to_ne_bytes());
    let err = parse_port_dump(&nameless).unwrap_err();
    assert!(err.to_string().contains("without its device name"), "{err}");
}

#[test]
fn read_ports_dumps_devices_then_each_devices_ports_and_an_empty_namespace_has_none() {
    let dir = "netns-exclusive/hca-pod";
    let mut socket = Fake(vec![
        Ok(vec![
            fixture(&format!("{dir}/devices-00.bin")),
            fixture(&format!("{dir}/devices-01.bin")),
        ]),
        Ok(captured_ports("hca-pod")),
    ]);
    let ports = read_ports(&mut socket).unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].device, "rxe0");
    // The agent's own namespace in exclusive mode: the device dump is one NLMSG_DONE.
    let mut socket = Fake(vec![Ok(vec![fixture(
        "netns-exclusive/pod/devices-00.bin",
    )])]);
    assert_eq!(read_ports(&mut socket).unwrap(), Vec::new());
}

#[test]
fn port_dump_requests_name_their_device() {
    let request = port_dump_request(7, 3);
    let message = NetlinkBuffer::new_checked(&request[..]).unwrap();
    assert_eq!(message.message_type(), (5 << 10) + 5);
    assert_eq!(message.sequence_number(), 7);
    assert_eq!(&request[16..24], &[8, 0, 1, 0, 3, 0, 0, 0]);
}
