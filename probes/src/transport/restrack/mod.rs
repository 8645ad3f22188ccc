//! RDMA resource tracking: every queue pair the kernel knows, with its device, port, type,
//! state and owner, as `rdma resource show qp` lists them.
//!
//! The requests and replies travel on `NETLINK_RDMA` (protocol 20), message type
//! `RDMA_NL_GET_TYPE(RDMA_NL_NLDEV, cmd)`; numbers from the kernel's
//! `include/uapi/rdma/rdma_netlink.h`. The kernel dumps QPs one device at a time (a QP dump
//! without `RDMA_NLDEV_ATTR_DEV_INDEX` is refused with `EINVAL`), so a reader first dumps the
//! devices (`RDMA_NLDEV_CMD_GET`), then each device's QPs (`RDMA_NLDEV_CMD_RES_QP_GET`). Each
//! QP reply message holds the device's index and name and a nested table of QP entries; a
//! user QP carries the creator's PID (only to a reader in its PID namespace or an ancestor:
//! the agent needs the host's), a kernel QP the name of its kernel module instead.
//!
//! The same interface lists each device's ports (`RDMA_NLDEV_CMD_PORT_GET`, one device at a
//! time too: what `rdma link show` prints), as the network namespace of the socket sees them:
//! in RDMA netns mode `exclusive` an HCA a DRA driver moved into a pod is listed only from a
//! socket opened in that pod's namespace ([`super::pod_hcas`]).
//!
//! The parsers are pure (bytes in, entries out) over `netlink-packet-core`'s buffers;
//! [`read_qps`] and [`read_ports`] drive them through any [`NetlinkDump`] (the probes' netlink
//! socket).

use crate::error::{ProbeError, Result};
use crate::netlink::{NetlinkDump, Protocol, Socket};
use crate::rdma::types::{PhysState, PortState};
use netlink_packet_core::{
    NLA_HEADER_SIZE, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer,
    NlaBuffer, NlasIterator, parse_string, parse_u8, parse_u32,
};
use serde::Serialize;
use std::io;

/// `NETLINK_RDMA`: the protocol number to open the socket with.
pub const NETLINK_RDMA: i32 = 20;
/// `RDMA_NL_NLDEV`: the RDMA device interface's client number.
const RDMA_NL_NLDEV: u16 = 5;
const RDMA_NLDEV_CMD_GET: u16 = 1;
const RDMA_NLDEV_CMD_PORT_GET: u16 = 5;
const RDMA_NLDEV_CMD_RES_QP_GET: u16 = 10;

// `enum rdma_nldev_attr` (ABI: the numbers never change).
const ATTR_DEV_INDEX: u16 = 1;
const ATTR_DEV_NAME: u16 = 2;
const ATTR_PORT_INDEX: u16 = 3;
const ATTR_PORT_STATE: u16 = 12;
const ATTR_PORT_PHYS_STATE: u16 = 13;
const ATTR_RES_QP: u16 = 19;
const ATTR_RES_QP_ENTRY: u16 = 20;
const ATTR_RES_LQPN: u16 = 21;
const ATTR_RES_RQPN: u16 = 22;
const ATTR_RES_TYPE: u16 = 26;
const ATTR_RES_STATE: u16 = 27;
const ATTR_RES_PID: u16 = 28;
const ATTR_RES_KERN_NAME: u16 = 29;
const ATTR_RES_PDN: u16 = 60;
const ATTR_NDEV_NAME: u16 = 51;

/// The netlink message type of an RDMA device interface command.
const fn nldev_type(command: u16) -> u16 {
    (RDMA_NL_NLDEV << 10) + command
}

const DEVICES: &str = "RDMA netlink device dump";
const QPS: &str = "RDMA netlink QP dump";
const PORTS: &str = "RDMA netlink port dump";

/// One RDMA device as the device dump lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RdmaDevice {
    pub index: u32,
    pub name: String,
}

/// A QP's transport type (`enum ib_qp_type`; `DRIVER` is a vendor's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum QpType {
    Smi,
    Gsi,
    Rc,
    Uc,
    Ud,
    RawIpv6,
    RawEthertype,
    RawPacket,
    XrcIni,
    XrcTgt,
    Driver,
    Other(u8),
}

impl QpType {
    fn from_kernel(value: u8) -> Self {
        match value {
            0 => Self::Smi,
            1 => Self::Gsi,
            2 => Self::Rc,
            3 => Self::Uc,
            4 => Self::Ud,
            5 => Self::RawIpv6,
            6 => Self::RawEthertype,
            8 => Self::RawPacket,
            9 => Self::XrcIni,
            10 => Self::XrcTgt,
            0xff => Self::Driver,
            other => Self::Other(other),
        }
    }
}

/// A QP's state (`enum ib_qp_state`); `Rts` is the one that moves data both ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
    Other(u8),
}

impl QpState {
    fn from_kernel(value: u8) -> Self {
        match value {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::Sqd,
            5 => Self::Sqe,
            6 => Self::Err,
            other => Self::Other(other),
        }
    }
}

/// Who created a QP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QpOwner {
    /// A user process, by its PID in the reader's PID namespace.
    Pid(u32),
    /// A kernel module (`ib_core` for the GSI QP): not a pod's.
    Kernel(String),
    /// Neither: the owner is in a PID namespace the reader cannot see into.
    Hidden,
}

/// One queue pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QpEntry {
    pub device_index: u32,
    /// `mlx5_0`, `rxe0`
    pub device: String,
    /// `None` for a QP not yet bound to a port.
    pub port: Option<u32>,
    /// The local QP number.
    pub lqpn: u32,
    /// The remote QP number (RC and UC only).
    pub rqpn: Option<u32>,
    pub qp_type: QpType,
    pub state: QpState,
    pub owner: QpOwner,
    /// The protection domain's number (kernels from 5.x).
    pub pdn: Option<u32>,
}

impl QpEntry {
    /// A QP that moves a job's data: RC, UC, XRC or a driver's own type (mlx5's DC), in RTS.
    /// UD and GSI do not: NCCL's data moves over RC, and a UD QP is what any verbs user (or a
    /// CM) holds without moving data.
    pub fn is_data_path(&self) -> bool {
        matches!(
            self.qp_type,
            QpType::Rc | QpType::Uc | QpType::XrcIni | QpType::XrcTgt | QpType::Driver
        ) && self.state == QpState::Rts
    }
}

/// One port of an RDMA device as the port dump lists it (`rdma link show`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetlinkPort {
    pub device: String,
    pub port: u32,
    /// `None` when the reply did not carry it.
    pub state: Option<PortState>,
    pub physical_state: Option<PhysState>,
    /// The port's netdev, when it is in the socket's namespace (RoCE).
    pub netdev: Option<String>,
}

impl NetlinkPort {
    /// `ACTIVE` with the link up: the port can carry traffic.
    pub fn is_active(&self) -> bool {
        self.state == Some(PortState::Active) && self.physical_state == Some(PhysState::LinkUp)
    }
}

/// The request for every RDMA device (`RDMA_NLDEV_CMD_GET`, dump).
pub fn device_dump_request(sequence: u32) -> Vec<u8> {
    request(RDMA_NLDEV_CMD_GET, sequence, None)
}

/// The request for every QP of the device of index `device_index`.
pub fn qp_dump_request(sequence: u32, device_index: u32) -> Vec<u8> {
    request(RDMA_NLDEV_CMD_RES_QP_GET, sequence, Some(device_index))
}

/// The request for every port of the device of index `device_index` (the kernel refuses a
/// port dump without one).
pub fn port_dump_request(sequence: u32, device_index: u32) -> Vec<u8> {
    request(RDMA_NLDEV_CMD_PORT_GET, sequence, Some(device_index))
}

fn request(command: u16, sequence: u32, device_index: Option<u32>) -> Vec<u8> {
    const HEADER: usize = 16;
    const U32_ATTR: usize = 8;
    let len = HEADER + device_index.map_or(0, |_| U32_ATTR);
    let mut bytes = vec![0u8; len];
    let mut message = NetlinkBuffer::new(&mut bytes[..]);
    message.set_length(len as u32);
    message.set_message_type(nldev_type(command));
    message.set_flags(NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP);
    message.set_sequence_number(sequence);
    if let Some(index) = device_index {
        let mut attr = NlaBuffer::new(&mut bytes[HEADER..]);
        attr.set_kind(ATTR_DEV_INDEX);
        attr.set_length(U32_ATTR as u16);
        attr.value_mut().copy_from_slice(&index.to_ne_bytes());
    }
    bytes
}

/// Parse the reply datagrams of a device dump.
///
/// # Errors
/// [`ProbeError::Netlink`] for a reply cut short or malformed, an error from the kernel, or
/// a dump without its `NLMSG_DONE`.
pub fn parse_device_dump<D: AsRef<[u8]>>(datagrams: &[D]) -> Result<Vec<RdmaDevice>> {
    let mut out = Vec::new();
    each_message(datagrams, DEVICES, RDMA_NLDEV_CMD_GET, |payload| {
        let (mut index, mut name) = (None, None);
        for attr in NlasIterator::new(payload) {
            let attr = attr.map_err(|e| malformed(DEVICES, e))?;
            match attr.kind() {
                ATTR_DEV_INDEX => index = Some(u32_of(DEVICES, &attr)?),
                ATTR_DEV_NAME => name = Some(string_of(DEVICES, &attr)?),
                _ => {}
            }
        }
        match (index, name) {
            (Some(index), Some(name)) => out.push(RdmaDevice { index, name }),
            _ => return Err(netlink(DEVICES, "a device without its index or name")),
        }
        Ok(())
    })?;
    Ok(out)
}

/// Parse the reply datagrams of one device's QP dump.
///
/// # Errors
/// As [`parse_device_dump`].
pub fn parse_qp_dump<D: AsRef<[u8]>>(datagrams: &[D]) -> Result<Vec<QpEntry>> {
    let mut out = Vec::new();
    each_message(datagrams, QPS, RDMA_NLDEV_CMD_RES_QP_GET, |payload| {
        parse_qp_message(payload, &mut out)
    })?;
    Ok(out)
}

/// Parse the reply datagrams of one device's port dump.
///
/// # Errors
/// As [`parse_device_dump`]; also a port without its device name or index.
pub fn parse_port_dump<D: AsRef<[u8]>>(datagrams: &[D]) -> Result<Vec<NetlinkPort>> {
    let mut out = Vec::new();
    each_message(datagrams, PORTS, RDMA_NLDEV_CMD_PORT_GET, |payload| {
        let (mut device, mut port, mut state, mut physical_state, mut netdev) =
            (None, None, None, None, None);
        for attr in NlasIterator::new(payload) {
            let attr = attr.map_err(|e| malformed(PORTS, e))?;
            match attr.kind() {
                ATTR_DEV_NAME => device = Some(string_of(PORTS, &attr)?),
                ATTR_PORT_INDEX => port = Some(u32_of(PORTS, &attr)?),
                ATTR_PORT_STATE => state = Some(PortState::from_code(u8_of(PORTS, &attr)?)),
                ATTR_PORT_PHYS_STATE => {
                    physical_state = Some(PhysState::from_code(u8_of(PORTS, &attr)?));
                }
                ATTR_NDEV_NAME => netdev = Some(string_of(PORTS, &attr)?),
                _ => {}
            }
        }
        let (Some(device), Some(port)) = (device, port) else {
            return Err(netlink(PORTS, "a port without its device name or index"));
        };
        out.push(NetlinkPort {
            device,
            port,
            state,
            physical_state,
            netdev,
        });
        Ok(())
    })?;
    Ok(out)
}

/// One QP reply message: the device, then the nested table of entries.
fn parse_qp_message(payload: &[u8], out: &mut Vec<QpEntry>) -> Result<()> {
    let (mut index, mut name, mut table) = (None, None, None);
    for attr in NlasIterator::new(payload) {
        let attr = attr.map_err(|e| malformed(QPS, e))?;
        match attr.kind() {
            ATTR_DEV_INDEX => index = Some(u32_of(QPS, &attr)?),
            ATTR_DEV_NAME => name = Some(string_of(QPS, &attr)?),
            ATTR_RES_QP => {
                // The table outlives this loop: take it from the message, not the attribute.
                let len = usize::from(attr.length());
                table = attr.into_inner().get(NLA_HEADER_SIZE..len);
            }
            _ => {}
        }
    }
    let (Some(device_index), Some(device)) = (index, name) else {
        return Err(netlink(
            QPS,
            "a QP message without its device index or name",
        ));
    };
    for entry in NlasIterator::new(table.unwrap_or_default()) {
        let entry = entry.map_err(|e| malformed(QPS, e))?;
        if entry.kind() == ATTR_RES_QP_ENTRY {
            out.push(parse_qp_entry(entry.value(), device_index, &device)?);
        }
    }
    Ok(())
}

fn parse_qp_entry(entry: &[u8], device_index: u32, device: &str) -> Result<QpEntry> {
    let (mut port, mut lqpn, mut rqpn, mut pdn) = (None, None, None, None);
    let (mut qp_type, mut state, mut owner) = (None, None, QpOwner::Hidden);
    for attr in NlasIterator::new(entry) {
        let attr = attr.map_err(|e| malformed(QPS, e))?;
        match attr.kind() {
            ATTR_PORT_INDEX => port = Some(u32_of(QPS, &attr)?),
            ATTR_RES_LQPN => lqpn = Some(u32_of(QPS, &attr)?),
            ATTR_RES_RQPN => rqpn = Some(u32_of(QPS, &attr)?),
            ATTR_RES_TYPE => qp_type = Some(u8_of(QPS, &attr)?),
            ATTR_RES_STATE => state = Some(u8_of(QPS, &attr)?),
            ATTR_RES_PID => owner = QpOwner::Pid(u32_of(QPS, &attr)?),
            ATTR_RES_KERN_NAME => owner = QpOwner::Kernel(string_of(QPS, &attr)?),
            ATTR_RES_PDN => pdn = Some(u32_of(QPS, &attr)?),
            _ => {}
        }
    }
    let (Some(lqpn), Some(qp_type), Some(state)) = (lqpn, qp_type, state) else {
        return Err(netlink(
            QPS,
            format!("a QP entry of {device} without its number, type or state"),
        ));
    };
    Ok(QpEntry {
        device_index,
        device: device.to_owned(),
        port,
        lqpn,
        rqpn,
        qp_type: QpType::from_kernel(qp_type),
        state: QpState::from_kernel(state),
        owner,
        pdn,
    })
}

/// Walk every netlink message of a dump's datagrams: `on_message` gets the payload of each
/// message of type `command`; `NLMSG_ERROR` and an `NLMSG_DONE` carrying a negative errno are
/// the kernel's refusal; the dump must end with `NLMSG_DONE`.
fn each_message<D: AsRef<[u8]>>(
    datagrams: &[D],
    request: &'static str,
    command: u16,
    mut on_message: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    for datagram in datagrams {
        let mut rest = datagram.as_ref();
        while !rest.is_empty() {
            let message = NetlinkBuffer::new_checked(rest).map_err(|e| malformed(request, e))?;
            let len = message.length() as usize;
            let payload = message.payload();
            match message.message_type() {
                NLMSG_DONE => {
                    // A dump whose start failed ends in NLMSG_DONE with the errno.
                    return match errno_of(payload) {
                        Some(errno) if errno < 0 => Err(refused(request, errno)),
                        _ => Ok(()),
                    };
                }
                NLMSG_ERROR => {
                    return Err(match errno_of(payload) {
                        Some(errno) if errno < 0 => refused(request, errno),
                        _ => netlink(request, "an acknowledgement before the dump's end"),
                    });
                }
                kind if kind == nldev_type(command) => on_message(payload)?,
                other => {
                    return Err(netlink(
                        request,
                        format!("unexpected message type {other:#06x}"),
                    ));
                }
            }
            // Messages are 4-byte aligned; the last one may end without padding.
            rest = rest.get(len.next_multiple_of(4)..).unwrap_or_default();
        }
    }
    Err(netlink(
        request,
        "the reply ended without NLMSG_DONE (cut short)",
    ))
}

fn errno_of(payload: &[u8]) -> Option<i32> {
    payload
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_ne_bytes)
}

fn u32_of(request: &'static str, attr: &NlaBuffer<&[u8]>) -> Result<u32> {
    parse_u32(attr.value()).map_err(|e| malformed(request, e))
}

fn u8_of(request: &'static str, attr: &NlaBuffer<&[u8]>) -> Result<u8> {
    parse_u8(attr.value()).map_err(|e| malformed(request, e))
}

fn string_of(request: &'static str, attr: &NlaBuffer<&[u8]>) -> Result<String> {
    parse_string(attr.value()).map_err(|e| malformed(request, e))
}

fn netlink(request: &'static str, message: impl Into<String>) -> ProbeError {
    ProbeError::netlink(request, message)
}

fn malformed(request: &'static str, e: impl std::fmt::Display) -> ProbeError {
    ProbeError::netlink_malformed(request, &e)
}

fn refused(request: &'static str, errno: i32) -> ProbeError {
    ProbeError::netlink_refused(request, errno.saturating_neg(), "")
}

/// Every QP of every RDMA device: a device dump, then one QP dump per device.
///
/// # Errors
/// [`ProbeError::RdmaNetlinkUnavailable`] when the kernel has no RDMA netlink (no `ib_core`);
/// [`ProbeError::Netlink`] for other I/O errors and bad replies.
pub fn read_qps(socket: &mut impl NetlinkDump) -> Result<Vec<QpEntry>> {
    per_device(socket, qp_dump_request, parse_qp_dump)
}

/// Every port of every RDMA device the socket's network namespace sees: a device dump, then
/// one port dump per device.
///
/// # Errors
/// As [`read_qps`].
pub fn read_ports(socket: &mut impl NetlinkDump) -> Result<Vec<NetlinkPort>> {
    per_device(socket, port_dump_request, parse_port_dump)
}

/// A device dump, then one dump per device (`request(sequence, device index)`), each reply
/// parsed with `parse`.
fn per_device<T>(
    socket: &mut impl NetlinkDump,
    request: fn(u32, u32) -> Vec<u8>,
    parse: fn(&[Vec<u8>]) -> Result<Vec<T>>,
) -> Result<Vec<T>> {
    let devices = parse_device_dump(&socket.dump(&device_dump_request(1)).map_err(io_error)?)?;
    let mut out = Vec::new();
    for (sequence, device) in (2..).zip(&devices) {
        let reply = socket
            .dump(&request(sequence, device.index))
            .map_err(io_error)?;
        out.extend(parse(&reply)?);
    }
    Ok(out)
}

/// Every QP of every RDMA device of this kernel, through a fresh `NETLINK_RDMA` socket.
///
/// # Errors
/// As [`read_qps`]; [`ProbeError::RdmaNetlinkUnavailable`] when the socket cannot be made for
/// want of the protocol.
pub fn read_live_qps() -> Result<Vec<QpEntry>> {
    let mut socket = Socket::open(Protocol::RDMA, 0).map_err(io_error)?;
    read_qps(&mut socket)
}

/// `EPROTONOSUPPORT` from `socket(AF_NETLINK, .., NETLINK_RDMA)` is the kernel without RDMA.
pub fn io_error(e: io::Error) -> ProbeError {
    if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) {
        ProbeError::RdmaNetlinkUnavailable { source: e }
    } else {
        netlink("RDMA netlink", e.to_string())
    }
}

#[cfg(test)]
mod tests;
