//! Parsers for what the kernel sends on the two netlink sockets of [`super::EventSources`]:
//! rtnetlink link messages (`RTM_NEWLINK`/`RTM_DELLINK`, uapi `linux/rtnetlink.h`,
//! `linux/if_link.h`) and kernel uevents (`lib/kobject_uevent.c`). The netlink framing is
//! [`crate::netlink::message`]'s.
//!
//! Pure functions over bytes: a truncated, misaligned or otherwise malformed message is
//! skipped (never a panic, never an out-of-bounds read), and the rest of the buffer is still
//! used where the framing allows it.

use crate::netlink::message::{NLMSG_DONE, attributes, messages, u32_at};
use serde::Serialize;

/// `struct ifinfomsg`: family (u8), pad (u8), type (u16), index (i32), flags (u32), change (u32).
const IFINFOMSG_LEN: usize = 16;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;

const IFLA_IFNAME: u16 = 3;
const IFLA_OPERSTATE: u16 = 16;
const IFLA_CARRIER: u16 = 33;

/// `net/if.h`.
const IFF_UP: u32 = 0x1;
const IFF_RUNNING: u32 = 0x40;
const IFF_LOWER_UP: u32 = 0x1_0000;

/// A netdev's link changed, appeared (`RTM_NEWLINK`) or went away (`RTM_DELLINK`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LinkChange {
    pub ifindex: i32,
    /// `IFLA_IFNAME`; absent when the message carried none (or not as UTF-8).
    pub name: Option<String>,
    /// `RTM_DELLINK`: the interface is gone.
    pub deleted: bool,
    /// `IFF_UP`: administratively up.
    pub up: bool,
    /// `IFF_LOWER_UP` (or `IFF_RUNNING`, or `IFLA_CARRIER`): the link has carrier.
    pub carrier: bool,
    /// `IFLA_OPERSTATE` as `ip link` names it (`UP`, `DOWN`, `LOWERLAYERDOWN`, ...).
    pub operstate: Option<&'static str>,
}

impl std::fmt::Display for LinkChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.name.as_deref().unwrap_or("?");
        if self.deleted {
            return write!(f, "{name} (ifindex {}) removed", self.ifindex);
        }
        write!(
            f,
            "{name} (ifindex {}) {}, {}",
            self.ifindex,
            if self.up { "up" } else { "down" },
            if self.carrier {
                "carrier"
            } else {
                "no carrier"
            }
        )?;
        if let Some(s) = self.operstate {
            write!(f, ", operstate {s}")?;
        }
        Ok(())
    }
}

/// `IF_OPER_*` of `linux/if.h` (RFC 2863), as `ip link` prints them.
fn operstate_name(v: u8) -> &'static str {
    match v {
        0 => "UNKNOWN",
        1 => "NOTPRESENT",
        2 => "DOWN",
        3 => "LOWERLAYERDOWN",
        4 => "TESTING",
        5 => "DORMANT",
        6 => "UP",
        _ => "INVALID",
    }
}

/// Every link message in one datagram from an `RTMGRP_LINK` subscription. Other message
/// types, and messages whose framing is broken, are skipped; a message whose length runs past
/// the buffer ends the walk.
pub fn parse_rtnetlink(buf: &[u8]) -> Vec<LinkChange> {
    messages(buf)
        .take_while(|m| m.kind != NLMSG_DONE)
        .filter(|m| m.kind == RTM_NEWLINK || m.kind == RTM_DELLINK)
        .filter_map(|m| parse_link(m.body, m.kind == RTM_DELLINK))
        .collect()
}

/// One `ifinfomsg` and its attributes.
fn parse_link(body: &[u8], deleted: bool) -> Option<LinkChange> {
    if body.len() < IFINFOMSG_LEN {
        return None;
    }
    let ifindex = u32_at(body, 4)? as i32;
    let flags = u32_at(body, 8)?;
    let mut change = LinkChange {
        ifindex,
        name: None,
        deleted,
        up: flags & IFF_UP != 0,
        carrier: flags & (IFF_LOWER_UP | IFF_RUNNING) != 0,
        operstate: None,
    };
    for attr in attributes(&body[IFINFOMSG_LEN..]) {
        let value = attr.value;
        match attr.kind {
            IFLA_IFNAME => {
                let name = value.split(|&b| b == 0).next().unwrap_or_default();
                change.name = std::str::from_utf8(name)
                    .ok()
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned);
            }
            IFLA_OPERSTATE => change.operstate = value.first().map(|&v| operstate_name(v)),
            IFLA_CARRIER => {
                if let Some(&c) = value.first() {
                    change.carrier = c != 0;
                }
            }
            _ => {}
        }
    }
    Some(change)
}

/// A kernel uevent: `ACTION@DEVPATH\0` then `KEY=VALUE\0` pairs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Uevent {
    /// `add`, `remove`, `change`, `move`, `online`, `offline`, `bind`, `unbind`.
    pub action: String,
    pub devpath: String,
    pub subsystem: String,
    /// The device's name: `INTERFACE` (net), `NAME` (infiniband), `DEVNAME`
    /// (infiniband_verbs: `infiniband/uverbs0`), else the last part of `DEVPATH`.
    pub name: String,
    pub seqnum: Option<u64>,
}

impl std::fmt::Display for Uevent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.action, self.subsystem, self.name)
    }
}

/// The subsystems whose uevents concern fabricgate: RDMA devices, their verbs device nodes,
/// and network interfaces (RoCE netdevs).
pub const UEVENT_SUBSYSTEMS: &[&str] = &["infiniband", "infiniband_verbs", "net"];

/// Upper bound on a uevent's text (the kernel's `UEVENT_BUFFER_SIZE` is 2048; a bit of slack).
const MAX_UEVENT_BYTES: usize = 8192;

/// One kernel uevent. `None` for a udev re-broadcast (`libudev\0` header: not the kernel's),
/// a message without `ACTION`/`DEVPATH`/`SUBSYSTEM`, an oversized one, or a header that does
/// not match its fields.
pub fn parse_uevent(buf: &[u8]) -> Option<Uevent> {
    if buf.len() > MAX_UEVENT_BYTES || buf.starts_with(b"libudev\0") {
        return None;
    }
    let mut parts = buf.split(|&b| b == 0).filter(|p| !p.is_empty());
    let header = std::str::from_utf8(parts.next()?).ok()?;
    let (h_action, h_devpath) = header.split_once('@')?;
    let mut action = None;
    let mut devpath = None;
    let mut subsystem = None;
    let mut name = None;
    let mut devname = None;
    let mut seqnum = None;
    for part in parts {
        let Ok(text) = std::str::from_utf8(part) else {
            continue;
        };
        let Some((key, value)) = text.split_once('=') else {
            continue;
        };
        match key {
            "ACTION" => action = Some(value),
            "DEVPATH" => devpath = Some(value),
            "SUBSYSTEM" => subsystem = Some(value),
            "INTERFACE" | "NAME" => name = Some(value),
            "DEVNAME" => devname = Some(value),
            "SEQNUM" => seqnum = value.parse().ok(),
            _ => {}
        }
    }
    let (action, devpath, subsystem) = (action?, devpath?, subsystem?);
    if action != h_action || devpath != h_devpath || action.is_empty() || subsystem.is_empty() {
        return None;
    }
    let name = name
        .or(devname)
        .or_else(|| devpath.rsplit('/').next())
        .unwrap_or_default();
    Some(Uevent {
        action: action.to_owned(),
        devpath: devpath.to_owned(),
        subsystem: subsystem.to_owned(),
        name: name.to_owned(),
        seqnum,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::message::NLMSG_HDRLEN;

    // Captured byte for byte from this kernel (scripts/capture_netlink.py, in a private
    // network namespace: a veth pair v0/v1 created, set up, v1 set down, v0 deleted).
    const NEWLINK_V1_DOWN: &[u8] = include_bytes!("testdata/rtnl-newlink-v1-down.bin");
    const NEWLINK_V1_RUNNING: &[u8] = include_bytes!("testdata/rtnl-newlink-v1-running.bin");
    const DELLINK_V0: &[u8] = include_bytes!("testdata/rtnl-dellink-v0.bin");
    const UEVENT_ADD_NET: &[u8] = include_bytes!("testdata/uevent-add-net-v0.bin");
    const UEVENT_REMOVE_NET: &[u8] = include_bytes!("testdata/uevent-remove-net-v0.bin");
    const UEVENT_ADD_QUEUE: &[u8] = include_bytes!("testdata/uevent-add-queue-rx0.bin");
    // Captured in the Soft-RoCE VM (Debian 6.1 kernel): `rdma link add rxe0 type rxe netdev
    // eth0`, `ip link set eth0 down`.
    const UEVENT_ADD_RXE0: &[u8] = include_bytes!("testdata/uevent-add-infiniband-rxe0.bin");
    const UEVENT_ADD_UVERBS0: &[u8] =
        include_bytes!("testdata/uevent-add-infiniband_verbs-uverbs0.bin");
    const NEWLINK_ETH0_DOWN: &[u8] = include_bytes!("testdata/rtnl-newlink-eth0-down.bin");

    #[test]
    fn a_real_newlink_of_an_interface_set_down() {
        let got = parse_rtnetlink(NEWLINK_V1_DOWN);
        assert_eq!(
            got,
            vec![LinkChange {
                ifindex: 2,
                name: Some("v1".into()),
                deleted: false,
                up: false,
                carrier: false,
                operstate: Some("DOWN"),
            }]
        );
        assert_eq!(
            got[0].to_string(),
            "v1 (ifindex 2) down, no carrier, operstate DOWN"
        );
    }

    #[test]
    fn a_real_newlink_of_an_interface_with_carrier() {
        let got = parse_rtnetlink(NEWLINK_V1_RUNNING);
        assert_eq!(got.len(), 1);
        assert!(got[0].up && got[0].carrier, "{:?}", got[0]);
        assert_eq!(got[0].operstate, Some("UP"));
    }

    #[test]
    fn a_real_dellink() {
        let got = parse_rtnetlink(DELLINK_V0);
        assert_eq!(got.len(), 1);
        assert!(got[0].deleted);
        assert_eq!(got[0].name.as_deref(), Some("v0"));
        assert_eq!(got[0].to_string(), "v0 (ifindex 3) removed");
    }

    #[test]
    fn a_real_newlink_of_the_rxe_netdev_in_the_vm() {
        let got = parse_rtnetlink(NEWLINK_ETH0_DOWN);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].name.as_deref(), Some("eth0"));
        assert!(!got[0].up, "{:?}", got[0]);
        assert!(!got[0].deleted);
    }

    #[test]
    fn two_messages_in_one_datagram_are_both_read() {
        let mut buf = NEWLINK_V1_DOWN.to_vec();
        buf.extend_from_slice(DELLINK_V0);
        let got = parse_rtnetlink(&buf);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].name.as_deref(), Some("v0"));
    }

    #[test]
    fn every_truncation_and_corruption_of_a_real_message_is_survived() {
        for cut in 0..NEWLINK_V1_DOWN.len() {
            let got = parse_rtnetlink(&NEWLINK_V1_DOWN[..cut]);
            // A message cut short runs past the buffer: nothing is reported from it.
            assert!(got.is_empty(), "cut at {cut}: {got:?}");
        }
        // Every single byte set to every interesting value: no panic, and never more
        // messages than the buffer has room for headers.
        let mut buf = NEWLINK_V1_DOWN.to_vec();
        for i in 0..buf.len() {
            let keep = buf[i];
            for v in [0u8, 1, 3, 4, 0x7f, 0x80, 0xff] {
                buf[i] = v;
                assert!(parse_rtnetlink(&buf).len() <= buf.len() / NLMSG_HDRLEN);
            }
            buf[i] = keep;
        }
    }

    #[test]
    fn non_link_messages_and_junk_are_ignored() {
        assert!(parse_rtnetlink(&[]).is_empty());
        assert!(parse_rtnetlink(&[0xff; 15]).is_empty());
        // nlmsg_len 0 would loop forever if trusted.
        assert!(parse_rtnetlink(&[0u8; 64]).is_empty());
        // An RTM_NEWADDR (20) of the right size is not a link message.
        let mut addr = NEWLINK_V1_DOWN.to_vec();
        addr[4] = 20;
        assert!(parse_rtnetlink(&addr).is_empty());
        // A link message whose body is shorter than ifinfomsg.
        let mut short = vec![0u8; NLMSG_HDRLEN + 8];
        let n = short.len() as u32;
        short[..4].copy_from_slice(&n.to_ne_bytes());
        short[4..6].copy_from_slice(&RTM_NEWLINK.to_ne_bytes());
        assert!(parse_rtnetlink(&short).is_empty());
        // An attribute with length 0 stops the attribute walk, not the message.
        let mut zero_attr = vec![0u8; NLMSG_HDRLEN + IFINFOMSG_LEN + 8];
        let n = zero_attr.len() as u32;
        zero_attr[..4].copy_from_slice(&n.to_ne_bytes());
        zero_attr[4..6].copy_from_slice(&RTM_NEWLINK.to_ne_bytes());
        let got = parse_rtnetlink(&zero_attr);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name, None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Random bytes, and a real message with random bytes spliced in: never a panic,
        /// never more messages than headers fit, and every name a real one could carry.
        #[test]
        fn rtnetlink_parsing_survives_any_bytes(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            at in 0usize..1492,
        ) {
            let got = parse_rtnetlink(&junk);
            proptest::prop_assert!(got.len() <= junk.len() / NLMSG_HDRLEN);
            let mut spliced = NEWLINK_V1_DOWN.to_vec();
            let end = (at + junk.len().min(64)).min(spliced.len());
            spliced[at.min(end)..end].copy_from_slice(&junk[..end - at.min(end)]);
            for l in parse_rtnetlink(&spliced) {
                proptest::prop_assert!(l.name.as_deref().is_none_or(|n| !n.contains('\0')));
            }
        }

        #[test]
        fn uevent_parsing_survives_any_bytes(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
        ) {
            if let Some(u) = parse_uevent(&junk) {
                proptest::prop_assert!(!u.action.is_empty() && !u.subsystem.is_empty());
            }
            let mut real = UEVENT_ADD_RXE0.to_vec();
            real.extend_from_slice(&junk);
            let _ = parse_uevent(&real);
        }
    }

    #[test]
    fn a_real_uevent_of_a_netdev_added_and_removed() {
        let add = parse_uevent(UEVENT_ADD_NET).unwrap();
        assert_eq!(
            add,
            Uevent {
                action: "add".into(),
                devpath: "/devices/virtual/net/v0".into(),
                subsystem: "net".into(),
                name: "v0".into(),
                seqnum: add.seqnum,
            }
        );
        assert!(add.seqnum.is_some());
        assert_eq!(add.to_string(), "add net v0");
        let remove = parse_uevent(UEVENT_REMOVE_NET).unwrap();
        assert_eq!(remove.action, "remove");
        assert_eq!(remove.name, "v0");
        let queue = parse_uevent(UEVENT_ADD_QUEUE).unwrap();
        assert_eq!(queue.subsystem, "queues");
        assert!(!UEVENT_SUBSYSTEMS.contains(&queue.subsystem.as_str()));
    }

    #[test]
    fn real_uevents_of_an_rdma_device_and_its_verbs_node() {
        let ib = parse_uevent(UEVENT_ADD_RXE0).unwrap();
        assert_eq!(ib.action, "add");
        assert_eq!(ib.subsystem, "infiniband");
        assert_eq!(ib.name, "rxe0");
        let uverbs = parse_uevent(UEVENT_ADD_UVERBS0).unwrap();
        assert_eq!(uverbs.subsystem, "infiniband_verbs");
        assert_eq!(uverbs.name, "infiniband/uverbs0");
    }

    #[test]
    fn uevents_that_are_not_the_kernels_or_are_malformed_are_ignored() {
        assert_eq!(parse_uevent(b""), None);
        assert_eq!(parse_uevent(b"libudev\0\xfe\xed\xca\xfe"), None);
        // Header and fields disagree.
        assert_eq!(
            parse_uevent(b"add@/a\0ACTION=remove\0DEVPATH=/a\0SUBSYSTEM=net\0"),
            None
        );
        // No SUBSYSTEM.
        assert_eq!(parse_uevent(b"add@/a\0ACTION=add\0DEVPATH=/a\0"), None);
        // No header.
        assert_eq!(
            parse_uevent(b"ACTION=add\0DEVPATH=/a\0SUBSYSTEM=net\0"),
            None
        );
        // Oversized.
        assert_eq!(parse_uevent(&vec![b'a'; MAX_UEVENT_BYTES + 1]), None);
        // Non-UTF-8 junk in a field is skipped; the rest parses.
        let e = parse_uevent(
            b"add@/x/net/eth9\0ACTION=add\0\xff\xfe\0DEVPATH=/x/net/eth9\0SUBSYSTEM=net\0",
        )
        .unwrap();
        assert_eq!(e.name, "eth9");
        // Every truncation of a real one: never a panic.
        for cut in 0..UEVENT_ADD_NET.len() {
            let _ = parse_uevent(&UEVENT_ADD_NET[..cut]);
        }
    }
}
