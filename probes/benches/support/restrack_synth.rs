//! A synthetic RDMA resource-tracking QP dump, laid out as the kernel's (the captured
//! `probes/tests/fixtures/restrack/qp-0-00.bin`): per message the device's index and name and
//! a nested table of entries with the same attributes as an RC QP there. Shared by the unit
//! tests (10,000 QPs) and `benches/restrack.rs`.

/// `qps` RC QPs on `device` (index `index`), owned round-robin by `pids`, `per_message` to a
/// message and one message to a datagram, then `NLMSG_DONE`.
pub fn qp_dump(index: u32, device: &str, qps: u32, pids: &[u32], per_message: u32) -> Vec<Vec<u8>> {
    let mut datagrams = Vec::new();
    let mut lqpn: u32 = 17;
    let mut left = qps;
    while left > 0 {
        let n = left.min(per_message);
        let mut table = Vec::new();
        for i in 0..n {
            let mut entry = Vec::new();
            attr(&mut entry, 3, &1u32.to_ne_bytes()); // port
            attr(&mut entry, 21, &lqpn.to_ne_bytes()); // lqpn
            attr(&mut entry, 60, &(1 + i % 8).to_ne_bytes()); // pdn
            let pid = pids[(lqpn as usize) % pids.len()];
            attr(&mut entry, 28, &pid.to_ne_bytes()); // pid
            attr(&mut entry, 22, &(lqpn + 1).to_ne_bytes()); // rqpn
            attr(&mut entry, 23, &5_017_111u32.to_ne_bytes()); // rq psn
            attr(&mut entry, 24, &13_187_046u32.to_ne_bytes()); // sq psn
            attr(&mut entry, 25, &[0]); // path mig state
            attr(&mut entry, 26, &[2]); // type RC
            attr(&mut entry, 27, &[3]); // state RTS
            attr(&mut table, 20, &entry);
            lqpn += 1;
        }
        let mut payload = Vec::new();
        attr(&mut payload, 1, &index.to_ne_bytes());
        let mut name = device.as_bytes().to_vec();
        name.push(0);
        attr(&mut payload, 2, &name);
        attr(&mut payload, 19, &table);
        datagrams.push(message((5 << 10) + 10, &payload));
        left -= n;
    }
    datagrams.push(message(3, &0i32.to_ne_bytes()));
    datagrams
}

fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&2u16.to_ne_bytes()); // NLM_F_MULTI
    out.extend_from_slice(&2u32.to_ne_bytes()); // sequence
    out.extend_from_slice(&0u32.to_ne_bytes()); // port id
    out.extend_from_slice(payload);
    out
}
