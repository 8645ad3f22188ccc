//! What the kernel announces, so a port that goes down is probed at once instead of at the
//! next interval: [`EventSources`] blocks on three kinds of events and reports them.
//!
//! - **rtnetlink** (`NETLINK_ROUTE`, group `RTMGRP_LINK`): a netdev went up or down, gained or
//!   lost carrier, appeared or was removed ([`LinkChange`]). A RoCE port follows its netdev.
//! - **uevents** (`NETLINK_KOBJECT_UEVENT`, group 1, the kernel's): devices of the
//!   `infiniband`, `infiniband_verbs` and `net` subsystems added or removed ([`Uevent`]).
//! - **verbs asynchronous events** on a context held open per RDMA device
//!   ([`AsyncEvent`]: `IBV_EVENT_PORT_ERR`, `PORT_ACTIVE`, `DEVICE_FATAL`, `GID_CHANGE`, ...).
//!   The contexts are re-opened when an RDMA device comes or goes.
//!
//! A source that cannot be opened (no netlink in the sandbox, no RDMA in the kernel, no
//! access to `/dev/infiniband`) is not an error: [`EventSources::status`] says which sources
//! listen and why the others do not, and the caller's interval remains the safety net.
//! Synchronous, like the rest of this crate: the agent runs [`EventSources::wait`] on a
//! thread of its own.

pub mod parse;

pub use crate::rdma::verbs::events::{AsyncEvent, AsyncEventKind};
pub use parse::{LinkChange, UEVENT_SUBSYSTEMS, Uevent, parse_rtnetlink, parse_uevent};

use crate::netlink::{self, Protocol, Received, Socket};
use crate::rdma::verbs::events::{self as verbs_events, AsyncContext};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use serde::Serialize;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `RTMGRP_LINK` (linux/rtnetlink.h).
const RTMGRP_LINK: u32 = 1;
/// The kernel's uevent multicast group (udev re-broadcasts on group 2, which is not read).
const UEVENT_GROUP_KERNEL: u32 = 1;
/// Datagrams one read of a socket takes at most: a sender that floods it (another process's
/// datagrams to the agent's netlink port) delays the next wait, never stops the loop.
const MAX_DATAGRAMS_PER_READ: usize = 1024;
/// Without uevents nothing says when an RDMA device appears: look for new ones this often.
const VERBS_RESCAN_WITHOUT_UEVENTS: Duration = Duration::from_secs(60);

/// Where an event came from; the names are the `trigger`/`source` label values of the
/// agent's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Source {
    Netlink,
    Uevent,
    VerbsAsync,
}

impl Source {
    pub const ALL: [Self; 3] = [Self::Netlink, Self::Uevent, Self::VerbsAsync];

    pub fn name(self) -> &'static str {
        match self {
            Self::Netlink => "netlink",
            Self::Uevent => "uevent",
            Self::VerbsAsync => "verbs_async",
        }
    }
}

/// One thing the kernel said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Event {
    Link(LinkChange),
    Uevent(Uevent),
    Verbs(AsyncEvent),
    /// Something changed but what is not known: the source lost messages (its receive
    /// buffer overran) or a verbs context broke.
    Lost {
        source: Source,
        why: String,
    },
}

impl Event {
    pub fn source(&self) -> Source {
        match self {
            Self::Link(_) => Source::Netlink,
            Self::Uevent(_) => Source::Uevent,
            Self::Verbs(_) => Source::VerbsAsync,
            Self::Lost { source, .. } => *source,
        }
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Link(l) => write!(f, "link {l}"),
            Self::Uevent(u) => write!(f, "uevent {u}"),
            Self::Verbs(v) => write!(f, "verbs {v}"),
            Self::Lost { source, why } => write!(f, "{}: {why}", source.name()),
        }
    }
}

/// Which sources to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventOptions {
    pub netlink: bool,
    pub uevent: bool,
    /// Verbs contexts (off when the agent runs with `--verbs off`).
    pub verbs: bool,
}

impl Default for EventOptions {
    fn default() -> Self {
        Self {
            netlink: true,
            uevent: true,
            verbs: true,
        }
    }
}

/// Whether a source listens now, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceStatus {
    pub source: Source,
    pub active: bool,
    /// Why it does not listen (or, for verbs, which devices it cannot open); `None` when
    /// it listens, was turned off, or (verbs) there is no RDMA device to listen to.
    pub problem: Option<String>,
}

/// The open sources. Not `Send` (the verbs contexts are raw libibverbs pointers): create it
/// on the thread that waits on it.
/// Wakes a thread blocked in [`EventSources::wait`] from another thread (an eventfd), so the
/// waiting thread can block for long without polling a "should I stop" flag.
#[derive(Debug, Clone)]
pub struct Waker(Option<Arc<OwnedFd>>);

impl Waker {
    /// `None` inside when no eventfd can be made (then waits must be short to notice a stop).
    pub fn new() -> Self {
        let fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        );
        Self(fd.ok().map(Arc::new))
    }

    /// Whether [`Self::wake`] really interrupts a wait.
    pub fn works(&self) -> bool {
        self.0.is_some()
    }

    /// End the current (or next) [`EventSources::wait`] of the sources given this waker.
    pub fn wake(&self) {
        if let Some(fd) = &self.0 {
            // EAGAIN (the counter is full) still leaves it readable: the wait ends anyway.
            let _ = rustix::io::write(fd.as_fd(), &1u64.to_ne_bytes());
        }
    }

    /// Reset the counter after a wake-up, so the next wait blocks again.
    fn drain(&self) {
        if let Some(fd) = &self.0 {
            let mut count = [0u8; 8];
            let _ = rustix::io::read(fd.as_fd(), &mut count);
        }
    }
}

impl Default for Waker {
    fn default() -> Self {
        Self::new()
    }
}

pub struct EventSources {
    options: EventOptions,
    waker: Option<Waker>,
    netlink: Option<Socket>,
    netlink_problem: Option<String>,
    uevent: Option<Socket>,
    uevent_problem: Option<String>,
    verbs: Vec<AsyncContext>,
    verbs_problem: Option<String>,
    last_verbs_scan: Instant,
    buf: Vec<u8>,
}

fn open_problem(what: &str, e: &std::io::Error) -> String {
    format!(
        "cannot listen to {what}: {e}; port changes are seen at the next interval probe \
         (the agent needs the host network namespace, hostNetwork: true)"
    )
}

/// Which descriptor a poll entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Waker,
    Netlink,
    Uevent,
    Verbs(usize),
}

impl EventSources {
    /// Open the sources `options` asks for. Never fails: what cannot be opened is in
    /// [`Self::status`].
    pub fn open(options: EventOptions) -> Self {
        let mut this = Self {
            options,
            waker: None,
            netlink: None,
            netlink_problem: None,
            uevent: None,
            uevent_problem: None,
            verbs: Vec::new(),
            verbs_problem: None,
            last_verbs_scan: Instant::now(),
            buf: vec![0; netlink::RECV_BUFFER],
        };
        if options.netlink {
            match Socket::open(Protocol::ROUTE, RTMGRP_LINK) {
                Ok(socket) => this.netlink = Some(socket),
                Err(e) => {
                    this.netlink_problem = Some(open_problem("rtnetlink link changes", &e));
                }
            }
        }
        if options.uevent {
            match Socket::open(Protocol::KOBJECT_UEVENT, UEVENT_GROUP_KERNEL) {
                Ok(socket) => this.uevent = Some(socket),
                Err(e) => this.uevent_problem = Some(open_problem("kernel uevents", &e)),
            }
        }
        this.rescan_verbs();
        this
    }

    /// (Re-)open a context on every RDMA device.
    fn rescan_verbs(&mut self) {
        self.last_verbs_scan = Instant::now();
        if !self.options.verbs {
            return;
        }
        // Close first: a device being removed may wait for its contexts.
        self.verbs.clear();
        let (contexts, problem) = verbs_events::open_all();
        self.verbs = contexts;
        self.verbs_problem = problem;
    }

    /// Which sources listen, in [`Source::ALL`] order.
    pub fn status(&self) -> [SourceStatus; 3] {
        [
            SourceStatus {
                source: Source::Netlink,
                active: self.netlink.is_some(),
                problem: self.netlink_problem.clone(),
            },
            SourceStatus {
                source: Source::Uevent,
                active: self.uevent.is_some(),
                problem: self.uevent_problem.clone(),
            },
            SourceStatus {
                source: Source::VerbsAsync,
                active: !self.verbs.is_empty(),
                problem: self.verbs_problem.clone(),
            },
        ]
    }

    /// Let `waker` end a [`Self::wait`] early (it then returns no events).
    pub fn set_waker(&mut self, waker: &Waker) {
        self.waker = waker.works().then(|| waker.clone());
    }

    /// The devices whose asynchronous events are listened to.
    pub fn verbs_devices(&self) -> Vec<String> {
        self.verbs.iter().map(|c| c.device().to_owned()).collect()
    }

    /// Block until at least one source has something, or `timeout` passes; return every
    /// event read (uevents of other subsystems and messages from user space are dropped, so
    /// the result may be empty).
    pub fn wait(&mut self, timeout: Duration) -> Vec<Event> {
        let mut events = Vec::new();
        let ready = self.poll_ready(timeout);
        let mut rescan = false;
        for (slot, flags) in ready {
            match slot {
                Slot::Waker => {
                    if let Some(w) = &self.waker {
                        w.drain();
                    }
                }
                Slot::Netlink => self.read_netlink(&mut events),
                Slot::Uevent => rescan |= self.read_uevents(&mut events),
                Slot::Verbs(i) => rescan |= self.read_verbs(i, flags, &mut events),
            }
        }
        let stale =
            self.uevent.is_none() && self.last_verbs_scan.elapsed() >= VERBS_RESCAN_WITHOUT_UEVENTS;
        if rescan || stale {
            self.rescan_verbs();
        }
        events
    }

    /// `poll` every open descriptor; the ready ones and their `revents`.
    fn poll_ready(&self, timeout: Duration) -> Vec<(Slot, PollFlags)> {
        let mut slots = Vec::with_capacity(3 + self.verbs.len());
        let mut fds = Vec::with_capacity(3 + self.verbs.len());
        if let Some(fd) = self.waker.as_ref().and_then(|w| w.0.as_ref()) {
            slots.push(Slot::Waker);
            fds.push(PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN));
        }
        if let Some(fd) = &self.netlink {
            slots.push(Slot::Netlink);
            fds.push(PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN));
        }
        if let Some(fd) = &self.uevent {
            slots.push(Slot::Uevent);
            fds.push(PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN));
        }
        for (i, c) in self.verbs.iter().enumerate() {
            slots.push(Slot::Verbs(i));
            fds.push(PollFd::from_borrowed_fd(c.fd(), PollFlags::IN));
        }
        let ts = Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        if fds.is_empty() {
            // Nothing to listen to: just wait, so the caller's loop does not spin.
            std::thread::sleep(timeout);
            return Vec::new();
        }
        match poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(Errno::INTR) => Vec::new(),
            Ok(_) => slots
                .into_iter()
                .zip(fds.iter().map(PollFd::revents))
                .filter(|(_, r)| !r.is_empty())
                .collect(),
            Err(_) => {
                // EINVAL/ENOMEM: wait the timeout rather than spin; the interval still probes.
                std::thread::sleep(timeout);
                Vec::new()
            }
        }
    }

    fn read_netlink(&mut self, events: &mut Vec<Event>) {
        let Some(socket) = &self.netlink else { return };
        for _ in 0..MAX_DATAGRAMS_PER_READ {
            match socket.try_recv(&mut self.buf) {
                Ok(Received::Kernel(n)) => {
                    events.extend(parse_rtnetlink(&self.buf[..n]).into_iter().map(Event::Link));
                }
                Ok(Received::Foreign) => {}
                Ok(Received::Empty) => return,
                Ok(Received::Overrun) => events.push(Event::Lost {
                    source: Source::Netlink,
                    why: "link messages lost (receive buffer overrun)".into(),
                }),
                Err(e) => {
                    self.netlink = None;
                    self.netlink_problem = Some(open_problem("rtnetlink link changes", &e));
                    events.push(Event::Lost {
                        source: Source::Netlink,
                        why: format!("socket failed: {e}"),
                    });
                    return;
                }
            }
        }
    }

    /// Read every pending uevent; true when an RDMA device may have come or gone.
    fn read_uevents(&mut self, events: &mut Vec<Event>) -> bool {
        let Some(socket) = &self.uevent else {
            return false;
        };
        let mut rdma_changed = false;
        for _ in 0..MAX_DATAGRAMS_PER_READ {
            match socket.try_recv(&mut self.buf) {
                Ok(Received::Kernel(n)) => {
                    let Some(u) = parse_uevent(&self.buf[..n]) else {
                        continue;
                    };
                    if !UEVENT_SUBSYSTEMS.contains(&u.subsystem.as_str()) {
                        continue;
                    }
                    rdma_changed |= u.subsystem.starts_with("infiniband");
                    events.push(Event::Uevent(u));
                }
                Ok(Received::Foreign) => {}
                Ok(Received::Empty) => return rdma_changed,
                Ok(Received::Overrun) => {
                    events.push(Event::Lost {
                        source: Source::Uevent,
                        why: "uevents lost (receive buffer overrun)".into(),
                    });
                    rdma_changed = true;
                }
                Err(e) => {
                    self.uevent = None;
                    self.uevent_problem = Some(open_problem("kernel uevents", &e));
                    events.push(Event::Lost {
                        source: Source::Uevent,
                        why: format!("socket failed: {e}"),
                    });
                    return true;
                }
            }
        }
        // More pending than one read takes: what is left is read on the next wait.
        rdma_changed
    }

    /// Drain one context; true when it broke (its device is gone) and the set must be
    /// re-opened.
    fn read_verbs(&mut self, i: usize, flags: PollFlags, events: &mut Vec<Event>) -> bool {
        let Some(ctx) = self.verbs.get_mut(i) else {
            return false;
        };
        let before = events.len();
        let mut got = Vec::new();
        let result = ctx.drain(&mut got);
        let fatal = got.iter().any(|e| e.kind == AsyncEventKind::DeviceFatal);
        events.extend(got.into_iter().map(Event::Verbs));
        let broken = flags.intersects(PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL);
        match result {
            Err(e) => {
                events.push(Event::Lost {
                    source: Source::VerbsAsync,
                    why: format!("{}: asynchronous events unreadable: {e}", ctx.device()),
                });
                true
            }
            Ok(()) if broken && events.len() == before => {
                events.push(Event::Lost {
                    source: Source::VerbsAsync,
                    why: format!("{}: the context's event descriptor failed", ctx.device()),
                });
                true
            }
            Ok(()) => fatal || broken,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_names_are_the_metric_label_values() {
        let names: Vec<&str> = Source::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names, ["netlink", "uevent", "verbs_async"]);
    }

    /// Whatever this host allows, opening never fails and a wait returns within its timeout.
    #[test]
    fn open_and_wait_on_this_host() {
        let mut sources = EventSources::open(EventOptions::default());
        let status = sources.status();
        for s in &status {
            assert!(s.active || s.problem.is_some() || s.source == Source::VerbsAsync);
        }
        let started = Instant::now();
        let _ = sources.wait(Duration::from_millis(50));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn nothing_asked_is_nothing_opened() {
        let sources = EventSources::open(EventOptions {
            netlink: false,
            uevent: false,
            verbs: false,
        });
        assert!(
            sources
                .status()
                .iter()
                .all(|s| !s.active && s.problem.is_none())
        );
        assert!(sources.verbs_devices().is_empty());
    }

    /// A long wait ends as soon as another thread wakes it, returns no events, and the next
    /// wait blocks again (the eventfd was drained).
    #[test]
    fn a_waker_ends_a_long_wait_from_another_thread() {
        let waker = Waker::new();
        assert!(
            waker.works(),
            "eventfd is available on every supported kernel"
        );
        // No kernel source, so nothing but the waker can end a wait early.
        let mut sources = EventSources::open(EventOptions {
            netlink: false,
            uevent: false,
            verbs: false,
        });
        sources.set_waker(&waker);
        let remote = waker.clone();
        let waking = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            remote.wake();
        });
        let started = Instant::now();
        let events = sources.wait(Duration::from_secs(600));
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the wake ended the wait"
        );
        assert!(events.is_empty(), "{events:?}");
        waking.join().unwrap();
        let started = Instant::now();
        let _ = sources.wait(Duration::from_millis(200));
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "a drained waker does not end the next wait"
        );
    }
}
