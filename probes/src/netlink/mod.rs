//! The netlink socket every kernel conversation of the probes goes through, whatever the
//! protocol: rtnetlink link notifications and kernel uevents (read by [`crate::events`]), and
//! requests answered by the kernel, one message or a dump of many (`NETLINK_RDMA`'s device and
//! resource tables, for one).
//!
//! [`Socket::open`] binds to a protocol's multicast groups; [`Socket::try_recv`] and
//! [`Socket::recv_within`] read one datagram, kept only when the kernel sent it;
//! [`Socket::dump_streamed`] (the one way to ask; [`Socket::dump_datagrams`] keeps what it
//! hands over) sends a request built with [`message::request`] and hands each reply datagram
//! to the caller until the kernel says it is done: `NLMSG_DONE`, its errno, or a single
//! answer. The framing ([`message`]) is pure and shared with the parsers. No `unsafe`: the
//! socket calls are rustix's.

pub mod message;

pub use message::{
    Attribute, Message, NLM_F_ACK, NLM_F_DUMP, NLM_F_MULTI, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN,
    attribute, attributes, messages,
};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::netlink::SocketAddrNetlink;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// One datagram: rtnetlink link notifications are a few KiB, uevents at most 2 KiB, and the
/// kernel fills a dump's datagrams up to 32 KiB.
pub const RECV_BUFFER: usize = 64 * 1024;

/// A netlink protocol: a `NETLINK_*` number of `linux/netlink.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol(u32);

impl Protocol {
    /// `NETLINK_ROUTE`: links, addresses, routes (rtnetlink).
    pub const ROUTE: Self = Self(0);
    /// `NETLINK_KOBJECT_UEVENT`: the kernel's device events.
    pub const KOBJECT_UEVENT: Self = Self(15);
    /// `NETLINK_RDMA`: RDMA devices, ports and resources (what `rdma` of iproute2 reads;
    /// message types are `RDMA_NL_GET_TYPE(client, op)`, uapi `rdma/rdma_netlink.h`).
    pub const RDMA: Self = Self(20);
    /// `NETLINK_SOCK_DIAG`: socket statistics of the socket's network namespace (what `ss`
    /// reads; `linux/sock_diag.h`).
    pub const SOCK_DIAG: Self = Self(4);

    /// Any other protocol, by number.
    pub const fn from_number(number: u32) -> Self {
        Self(number)
    }

    pub const fn number(self) -> u32 {
        self.0
    }

    /// As rustix takes it: protocol 0 is no protocol.
    fn raw(self) -> Option<rustix::net::Protocol> {
        rustix::net::RawProtocol::new(self.0).map(rustix::net::Protocol::from_raw)
    }
}

/// What one read returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// A datagram of this many bytes from the kernel.
    Kernel(usize),
    /// A datagram from a user-space sender: ignored.
    Foreign,
    /// Nothing to read (now, or within the time given).
    Empty,
    /// The receive buffer overran: messages were lost.
    Overrun,
}

/// A netlink socket, non-blocking and closed on exec.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    /// The sequence number of the last request.
    seq: u32,
}

impl Socket {
    /// A socket of `protocol` subscribed to the multicast `groups` (a bit mask; 0 for a socket
    /// that only sends requests).
    ///
    /// # Errors
    /// The socket cannot be made or bound (no netlink in this sandbox, a protocol this kernel
    /// lacks, a group it refuses).
    pub fn open(protocol: Protocol, groups: u32) -> io::Result<Self> {
        // For netlink, SOCK_RAW and SOCK_DGRAM are one and the same.
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            protocol.raw(),
        )?;
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, groups))?;
        Ok(Self { fd, seq: 0 })
    }

    /// A socket of `protocol` in the network namespace `ns` (`/proc/<pid>/ns/net`): a
    /// dedicated thread enters the namespace, opens the socket and ends, so no thread of the
    /// agent stays in a pod's namespace; the socket keeps the namespace it was made in.
    /// Opening `ns` of another user's process needs `CAP_SYS_PTRACE`; entering it needs
    /// `CAP_SYS_ADMIN`.
    ///
    /// # Errors
    /// `ns` cannot be opened (the process exited: `NotFound`), `setns` was refused
    /// (`PermissionDenied`), or the socket cannot be made.
    pub fn open_in_netns(protocol: Protocol, ns: &std::path::Path) -> io::Result<Self> {
        let file = std::fs::File::open(ns)?;
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    rustix::thread::move_into_link_name_space(
                        std::os::fd::AsFd::as_fd(&file),
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )?;
                    Self::open(protocol, 0)
                })
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
        })
    }

    /// Read one datagram if one is waiting; only what the kernel sent is kept.
    ///
    /// # Errors
    /// The socket failed (anything but "nothing now", an interrupt or an overrun).
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        match rustix::net::recvfrom(&self.fd, &mut *buf, RecvFlags::empty()) {
            Ok((_, len, addr)) => {
                let from_kernel = addr
                    .and_then(|a| SocketAddrNetlink::try_from(a).ok())
                    .is_some_and(|a| a.pid() == 0);
                Ok(if from_kernel {
                    Received::Kernel(len.min(buf.len()))
                } else {
                    Received::Foreign
                })
            }
            Err(Errno::AGAIN | Errno::INTR) => Ok(Received::Empty),
            Err(Errno::NOBUFS) => Ok(Received::Overrun),
            Err(e) => Err(e.into()),
        }
    }

    /// [`Self::try_recv`], waiting up to `timeout` for a datagram.
    ///
    /// # Errors
    /// As [`Self::try_recv`], or `poll` failed.
    pub fn recv_within(&self, buf: &mut [u8], timeout: Duration) -> io::Result<Received> {
        let wait = Timespec::try_from(timeout).unwrap_or(Timespec {
            tv_sec: i64::MAX,
            tv_nsec: 0,
        });
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        match poll(&mut fds, Some(&wait)) {
            Ok(0) | Err(Errno::INTR) => Ok(Received::Empty),
            Ok(_) => self.try_recv(buf),
            Err(e) => Err(e.into()),
        }
    }

    /// Send one message (see [`message::request`]) to the kernel.
    ///
    /// # Errors
    /// The kernel did not take all of it.
    pub fn send(&self, message: &[u8]) -> io::Result<()> {
        let kernel = SocketAddrNetlink::new(0, 0);
        let sent = rustix::net::sendto(&self.fd, message, SendFlags::empty(), &kernel)?;
        if sent == message.len() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("netlink: {sent} of {} bytes sent", message.len()),
            ))
        }
    }

    /// Send `request`, a whole message built by the caller (its sequence number is replaced
    /// by this socket's own), and return the kernel's reply datagrams as they came, up to
    /// and including the one that ends it (`NLMSG_DONE`, `NLMSG_ERROR`, or a single answer
    /// without `NLM_F_MULTI`). For parsers of their own framing (`transport::restrack`,
    /// `transport::tcp`): the kernel's refusal is in the datagrams for them to read.
    ///
    /// # Errors
    /// `request` is shorter than a netlink header, the socket failed, the reply overran the
    /// buffer, or nothing came within `timeout`.
    pub fn dump_datagrams(
        &mut self,
        request: &[u8],
        timeout: Duration,
    ) -> io::Result<Vec<Vec<u8>>> {
        let mut datagrams = Vec::new();
        self.dump_streamed(request, timeout, |datagram| {
            datagrams.push(datagram.to_vec());
            false
        })?;
        Ok(datagrams)
    }

    /// The socket's one way to ask: [`Self::dump_datagrams`] without keeping them, each reply
    /// datagram handed to `each` as it comes; `each` may end the wait early by answering
    /// `true` (the rest of the answer is left unread: drop the socket then). What a dump holds
    /// is bounded by what `each` keeps, not by the kernel's answer.
    ///
    /// # Errors
    /// As [`Self::dump_datagrams`].
    pub fn dump_streamed(
        &mut self,
        request: &[u8],
        timeout: Duration,
        mut each: impl FnMut(&[u8]) -> bool,
    ) -> io::Result<()> {
        if request.len() < NLMSG_HDRLEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "netlink: a request shorter than its header",
            ));
        }
        let seq = self.next_seq();
        let mut stamped = request.to_vec();
        stamped[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.send(&stamped)?;
        let kind = message::u16_at(request, 4).unwrap_or_default();
        let answer = Answer { kind, seq, timeout };
        answer.receive(
            |buf, left| self.recv_within(buf, left),
            |datagram, ours| {
                let last = ours.iter().any(|m| {
                    matches!(m.kind, NLMSG_DONE | NLMSG_ERROR) || m.flags & NLM_F_MULTI == 0
                });
                each(datagram) || last
            },
        )
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }
}

/// Sends one dump request and returns the reply datagrams up to and including the one with
/// `NLMSG_DONE` (or `NLMSG_ERROR`). [`Socket`] implements it; a test hands recorded replies.
pub trait NetlinkDump {
    /// # Errors
    /// The socket's I/O error; `EPROTONOSUPPORT` when the kernel has no such protocol.
    fn dump(&mut self, request: &[u8]) -> io::Result<Vec<Vec<u8>>>;

    /// The same dump, each reply datagram handed to `each` as it comes; `each` answers `true`
    /// to stop reading (the socket is then not to be used again). Recorded replies are handed
    /// over one by one; the probes' socket streams them, so nothing is kept but what `each`
    /// keeps.
    ///
    /// # Errors
    /// As [`NetlinkDump::dump`].
    fn dump_each(&mut self, request: &[u8], each: &mut dyn FnMut(&[u8]) -> bool) -> io::Result<()> {
        for datagram in self.dump(request)? {
            if each(&datagram) {
                break;
            }
        }
        Ok(())
    }
}

/// How long one dump may take: the kernel answers a dump of 10,000 QPs or 100,000 sockets
/// in well under this.
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(5);

/// The probes' one netlink socket, for any protocol's dumps (`NETLINK_RDMA` in
/// `transport::restrack`, `NETLINK_SOCK_DIAG` in `transport::tcp`).
impl NetlinkDump for Socket {
    fn dump(&mut self, request: &[u8]) -> io::Result<Vec<Vec<u8>>> {
        self.dump_datagrams(request, DUMP_TIMEOUT)
    }

    fn dump_each(&mut self, request: &[u8], each: &mut dyn FnMut(&[u8]) -> bool) -> io::Result<()> {
        self.dump_streamed(request, DUMP_TIMEOUT, each)
    }
}

/// The answer a request waits for: its kind and sequence number, within `timeout`.
struct Answer {
    kind: u16,
    seq: u32,
    timeout: Duration,
}

impl Answer {
    /// The one receive loop: hand `each` every kernel datagram that answers the request (with
    /// its messages of the request's sequence number) until `each` says the answer is
    /// complete, reading with `recv` (a wait of at most the time left). Bounded by the
    /// timeout whatever arrives: a sender that floods the socket (another process's datagrams,
    /// the kernel's notifications) never keeps it waiting.
    fn receive(
        &self,
        mut recv: impl FnMut(&mut [u8], Duration) -> io::Result<Received>,
        mut each: impl FnMut(&[u8], &[Message<'_>]) -> bool,
    ) -> io::Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut buf = vec![0u8; RECV_BUFFER];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "netlink: no answer to request type {} within {:?}",
                        self.kind, self.timeout
                    ),
                ));
            }
            let n = match recv(&mut buf, left)? {
                Received::Kernel(n) => n,
                Received::Foreign | Received::Empty => continue,
                Received::Overrun => {
                    return Err(io::Error::other(
                        "netlink: the receive buffer overran; the answer is incomplete",
                    ));
                }
            };
            let datagram = &buf[..n.min(buf.len())];
            let ours: Vec<Message<'_>> = messages(datagram).filter(|m| m.seq == self.seq).collect();
            if !ours.is_empty() && each(datagram, &ours) {
                return Ok(());
            }
        }
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RTM_GETLINK`, `RTM_NEWLINK` (linux/rtnetlink.h) and an empty `struct ifinfomsg`.
    const RTM_GETLINK: u16 = 18;
    const RTM_NEWLINK: u16 = 16;
    const IFINFOMSG: [u8; 16] = [0; 16];

    /// A socket of this host, or `None` (and a note) where the sandbox has no netlink.
    fn route_socket(groups: u32) -> Option<Socket> {
        match Socket::open(Protocol::ROUTE, groups) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("no rtnetlink here ({e}): the socket half is not tested");
                None
            }
        }
    }

    /// Every network namespace has `lo`: a dump of the links lists it, and a second request
    /// on the same socket gets its own answers.
    #[test]
    fn a_route_dump_lists_this_hosts_links() {
        let Some(mut socket) = route_socket(0) else {
            return;
        };
        for _ in 0..2 {
            let request = message::request(RTM_GETLINK, NLM_F_DUMP, 0, &IFINFOMSG);
            let datagrams = socket
                .dump_datagrams(&request, Duration::from_secs(5))
                .unwrap();
            let mut names = Vec::new();
            for m in datagrams.iter().flat_map(|d| messages(d)) {
                if m.kind == NLMSG_DONE {
                    continue;
                }
                assert_eq!(m.kind, RTM_NEWLINK);
                let ifname = attributes(m.body.get(16..).unwrap_or_default())
                    .find(|a| a.kind == 3)
                    .map(|a| String::from_utf8_lossy(a.value).into_owned());
                names.extend(ifname);
            }
            assert!(names.iter().any(|n| n == "lo\0"), "{names:?}");
        }
    }

    /// The kernel's refusal ends the answer and carries its errno: a request type rtnetlink
    /// does not know.
    #[test]
    fn a_refused_request_is_the_kernels_errno() {
        let Some(mut socket) = route_socket(0) else {
            return;
        };
        let request = message::request(0x7ff0, NLM_F_ACK, 0, &[]);
        let datagrams = socket
            .dump_datagrams(&request, Duration::from_secs(5))
            .unwrap();
        let last = datagrams.last().and_then(|d| messages(d).last()).unwrap();
        assert_eq!(last.kind, NLMSG_ERROR, "{last:?}");
        assert!(last.status().is_some_and(|errno| errno > 0), "{last:?}");
    }

    /// Another process in the agent's network namespace (a pod with `CAP_NET_ADMIN` on the
    /// host's network) floods the agent's netlink port with datagrams of its own: a request
    /// still ends at its deadline. The request here is one the kernel never answers (a header
    /// without `NLM_F_REQUEST`), so only the deadline can end it; the flood keeps the socket
    /// readable and stops by itself after 5 s. (A real flood has gaps, in which the old loop
    /// also ended; an endless one is `redteam_an_endless_stream_that_is_not_the_answer_...`.)
    #[test]
    fn a_flood_of_foreign_datagrams_never_holds_a_request_past_its_deadline() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let Some(mut socket) = route_socket(0) else {
            return;
        };
        let Some(port) = rustix::net::getsockname(&socket.fd)
            .ok()
            .and_then(|a| SocketAddrNetlink::try_from(a).ok())
            .map(|a| a.pid())
        else {
            panic!("the socket has no netlink address");
        };
        let sent = std::sync::Arc::new(AtomicU64::new(0));
        let counted = std::sync::Arc::clone(&sent);
        let flooder = std::thread::spawn(move || {
            let Ok(from) = Socket::open(Protocol::ROUTE, 0) else {
                return;
            };
            let to = SocketAddrNetlink::new(port, 0);
            let junk = message::request(18, 0, 1, &[]);
            let until = Instant::now() + Duration::from_secs(5);
            while Instant::now() < until {
                if rustix::net::sendto(&from.fd, &junk, SendFlags::empty(), &to).is_ok() {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        while sent.load(Ordering::Relaxed) < 100 {
            std::thread::sleep(Duration::from_millis(5));
        }
        // RTM_GETLINK without NLM_F_REQUEST: the kernel takes it and answers nothing.
        let mut unanswered = message::request(18, 0, 0, &[]);
        unanswered[6..8].copy_from_slice(&0u16.to_ne_bytes());
        let started = Instant::now();
        let got = socket.dump_datagrams(&unanswered, Duration::from_millis(300));
        let took = started.elapsed();
        let _ = flooder.join();
        let e = got.expect_err("no answer can come");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(
            took < Duration::from_secs(2),
            "the deadline of 300 ms held only {took:?} while {} foreign datagrams came",
            sent.load(Ordering::Relaxed)
        );
    }

    /// Whatever a receive returns forever (another sender's datagrams, or the kernel's that
    /// answer something else), the wait for an answer ends at its deadline.
    #[test]
    fn redteam_an_endless_stream_that_is_not_the_answer_ends_at_the_deadline() {
        let answer = Answer {
            kind: 18,
            seq: 7,
            timeout: Duration::from_millis(100),
        };
        let other = message::request(18, 0, 8, &[]);
        let sources: [(&str, Received); 2] = [
            ("foreign", Received::Foreign),
            ("another answer", Received::Kernel(other.len())),
        ];
        for (what, received) in sources {
            let started = Instant::now();
            let got = answer.receive(
                |buf, _| {
                    buf[..other.len()].copy_from_slice(&other);
                    if started.elapsed() > Duration::from_secs(3) {
                        return Err(io::Error::other("still reading after 3 s"));
                    }
                    Ok(received)
                },
                |_, _| true,
            );
            let e = got.expect_err(what);
            assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{what}: {e}");
        }
    }

    /// A wait with nothing to read ends at its timeout with `Empty`.
    #[test]
    fn a_wait_without_datagrams_ends_empty() {
        let Some(socket) = route_socket(0) else {
            return;
        };
        let mut buf = [0u8; 64];
        let started = Instant::now();
        assert_eq!(
            socket
                .recv_within(&mut buf, Duration::from_millis(50))
                .unwrap(),
            Received::Empty
        );
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(socket.try_recv(&mut buf).unwrap(), Received::Empty);
    }

    #[test]
    fn protocols_are_the_kernels_numbers() {
        assert_eq!(Protocol::ROUTE.number(), 0);
        assert!(Protocol::ROUTE.raw().is_none());
        assert_eq!(
            Protocol::KOBJECT_UEVENT.raw(),
            Some(rustix::net::netlink::KOBJECT_UEVENT)
        );
        assert_eq!(Protocol::RDMA.raw(), Some(rustix::net::netlink::RDMA));
        assert_eq!(Protocol::from_number(20), Protocol::RDMA);
    }
}
