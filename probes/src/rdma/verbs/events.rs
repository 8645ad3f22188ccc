//! libibverbs asynchronous events: every open device context delivers port and device events
//! (`IBV_EVENT_PORT_ERR`, `PORT_ACTIVE`, `DEVICE_FATAL`, `GID_CHANGE`, `LID_CHANGE`, ...) on
//! its `async_fd`. [`AsyncContext`] keeps one context per device open for the agent's life,
//! with that descriptor non-blocking so it can be `poll`ed beside the netlink sockets
//! (`crate::events`), and [`AsyncContext::drain`] reads and acknowledges every pending event.
//!
//! A context whose device went away (`DEVICE_FATAL`, or `EIO`/`POLLERR` on its descriptor
//! once the kernel disassociated it) must be closed at once: a driver without
//! disassociation waits for every open context before it can finish removing the device.

use super::{Device, DeviceList, open_advice};
use rdma_sys as sys;
use serde::Serialize;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::raw::{c_int, c_uint};
use std::ptr::NonNull;

/// What an asynchronous event says (`enum ibv_event_type`, verbs.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum AsyncEventKind {
    PortError,
    PortActive,
    DeviceFatal,
    LidChange,
    PkeyChange,
    SmChange,
    ClientReregister,
    GidChange,
    /// A QP, CQ, SRQ or WQ event (none are created on these contexts), or a type this
    /// build does not know: the raw `event_type`.
    Other(u32),
}

impl AsyncEventKind {
    fn from_raw(t: c_uint) -> Self {
        use sys::ibv_event_type as E;
        match t {
            x if x == E::IBV_EVENT_PORT_ERR as c_uint => Self::PortError,
            x if x == E::IBV_EVENT_PORT_ACTIVE as c_uint => Self::PortActive,
            x if x == E::IBV_EVENT_DEVICE_FATAL as c_uint => Self::DeviceFatal,
            x if x == E::IBV_EVENT_LID_CHANGE as c_uint => Self::LidChange,
            x if x == E::IBV_EVENT_PKEY_CHANGE as c_uint => Self::PkeyChange,
            x if x == E::IBV_EVENT_SM_CHANGE as c_uint => Self::SmChange,
            x if x == E::IBV_EVENT_CLIENT_REREGISTER as c_uint => Self::ClientReregister,
            x if x == E::IBV_EVENT_GID_CHANGE as c_uint => Self::GidChange,
            other => Self::Other(other),
        }
    }

    /// Events whose `element` is a port number.
    fn is_port_event(self) -> bool {
        matches!(
            self,
            Self::PortError
                | Self::PortActive
                | Self::LidChange
                | Self::PkeyChange
                | Self::SmChange
                | Self::ClientReregister
                | Self::GidChange
        )
    }

    /// The libibverbs name (`IBV_EVENT_PORT_ERR`), as `ibv_asyncwatch` prints it.
    pub fn name(self) -> String {
        match self {
            Self::PortError => "IBV_EVENT_PORT_ERR".into(),
            Self::PortActive => "IBV_EVENT_PORT_ACTIVE".into(),
            Self::DeviceFatal => "IBV_EVENT_DEVICE_FATAL".into(),
            Self::LidChange => "IBV_EVENT_LID_CHANGE".into(),
            Self::PkeyChange => "IBV_EVENT_PKEY_CHANGE".into(),
            Self::SmChange => "IBV_EVENT_SM_CHANGE".into(),
            Self::ClientReregister => "IBV_EVENT_CLIENT_REREGISTER".into(),
            Self::GidChange => "IBV_EVENT_GID_CHANGE".into(),
            Self::Other(t) => format!("event type {t}"),
        }
    }
}

/// One asynchronous event, acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AsyncEvent {
    pub device: String,
    /// The port of a port event.
    pub port: Option<u32>,
    pub kind: AsyncEventKind,
}

impl std::fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{} port {p} {}", self.device, self.kind.name()),
            None => write!(f, "{} {}", self.device, self.kind.name()),
        }
    }
}

/// `struct ibv_async_event` with the event type read as a plain integer: `rdma-sys` declares
/// `event_type` as a Rust enum, and a value outside it (a newer libibverbs, a provider's own
/// event) would be undefined behaviour to read. Same size and layout as the C struct (the
/// element union of pointers and an `int`, then the enum, an `unsigned int` in C).
#[repr(C)]
struct RawAsyncEvent {
    element: sys::ibv_async_event_element_t,
    event_type: c_uint,
}

const _: () = {
    assert!(std::mem::size_of::<RawAsyncEvent>() == std::mem::size_of::<sys::ibv_async_event>());
    assert!(std::mem::align_of::<RawAsyncEvent>() == std::mem::align_of::<sys::ibv_async_event>());
};

/// A device context held open for its asynchronous events; closed on drop. It does not
/// borrow the [`DeviceList`] it was opened from: libibverbs keeps an opened device valid
/// after `ibv_free_device_list` (ibv_get_device_list(3)).
pub struct AsyncContext {
    ptr: NonNull<sys::ibv_context>,
    device: String,
}

impl AsyncContext {
    /// Open `device` and make its async-event descriptor non-blocking.
    ///
    /// # Errors
    /// The errno of `ibv_open_device`, or of setting `O_NONBLOCK` on the descriptor.
    fn open(device: &Device<'_>) -> io::Result<Self> {
        let ctx = device.open()?;
        let ptr = ctx.ptr;
        // The context now belongs to this value (closed by our Drop, not Context's).
        std::mem::forget(ctx);
        let this = Self {
            ptr: NonNull::new(ptr).ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))?,
            device: device.name(),
        };
        rustix::io::ioctl_fionbio(this.fd(), true)?;
        Ok(this)
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// The context's async-event descriptor, to `poll` for `POLLIN`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `ptr` is an open context (closed only in Drop, which cannot run while this
        // borrow of `self` lives); `async_fd` is set by ibv_open_device and stays open until
        // ibv_close_device.
        let fd: c_int = unsafe { (*self.ptr.as_ptr()).async_fd };
        // SAFETY: as above: the descriptor outlives the returned borrow of `self`.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }

    /// Read and acknowledge every pending event into `out`.
    ///
    /// # Errors
    /// Any error but "nothing pending" (`EAGAIN`): the context is no longer usable (the
    /// device was removed, `EIO`) and should be dropped.
    pub fn drain(&mut self, out: &mut Vec<AsyncEvent>) -> io::Result<()> {
        // A burst is bounded: a context that never runs dry is treated as broken.
        for _ in 0..1024 {
            // SAFETY: an all-zero RawAsyncEvent is valid (a null pointer / zero port in
            // the union, event type 0).
            let mut ev: RawAsyncEvent = unsafe { std::mem::zeroed() };
            // SAFETY: `ptr` is an open context; `ev` has the size and alignment of
            // `ibv_async_event` (checked at compile time above) and libibverbs writes only
            // an `int`-sized enum value into `event_type`, read here as `c_uint`.
            let rc = unsafe {
                sys::ibv_get_async_event(
                    self.ptr.as_ptr(),
                    (&raw mut ev).cast::<sys::ibv_async_event>(),
                )
            };
            if rc != 0 {
                let err = io::Error::last_os_error();
                return match err.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(()),
                    Some(0) | None => Err(io::Error::from_raw_os_error(libc::EIO)),
                    _ => Err(err),
                };
            }
            let kind = AsyncEventKind::from_raw(ev.event_type);
            let port = if kind.is_port_event() {
                // SAFETY: for port events libibverbs sets the `port_num` member.
                u32::try_from(unsafe { ev.element.port_num }).ok()
            } else {
                None
            };
            // SAFETY: every event returned by ibv_get_async_event is acknowledged exactly
            // once, with the same struct, before the next one is read.
            unsafe {
                sys::ibv_ack_async_event((&raw mut ev).cast::<sys::ibv_async_event>());
            }
            out.push(AsyncEvent {
                device: self.device.clone(),
                port,
                kind,
            });
        }
        Err(io::Error::other(format!(
            "{}: more than 1024 asynchronous events in one read",
            self.device
        )))
    }
}

impl Drop for AsyncContext {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from ibv_open_device, every event read was acknowledged, and it
        // is closed exactly once, here. A failure cannot be acted upon in Drop.
        let _ = unsafe { sys::ibv_close_device(self.ptr.as_ptr()) };
    }
}

/// Open every device libibverbs lists. Returns the contexts and, when something could not be
/// opened, what and why (naming the device node and what to do).
pub fn open_all() -> (Vec<AsyncContext>, Option<String>) {
    let list = match DeviceList::new() {
        Ok(list) => list,
        Err(e) => return (Vec::new(), Some(super::list_advice(&e))),
    };
    let mut contexts = Vec::new();
    let mut problems = Vec::new();
    for device in list.iter() {
        match AsyncContext::open(&device) {
            Ok(c) => contexts.push(c),
            Err(e) => problems.push(open_advice(&device.dev_path(), &e)),
        }
    }
    // The contexts stay valid after the list is freed (dropped here).
    drop(list);
    let problem = (!problems.is_empty()).then(|| problems.join("; "));
    (contexts, problem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_types_map_to_their_names() {
        use sys::ibv_event_type as E;
        assert_eq!(
            AsyncEventKind::from_raw(E::IBV_EVENT_PORT_ERR as c_uint),
            AsyncEventKind::PortError
        );
        assert_eq!(AsyncEventKind::from_raw(10), AsyncEventKind::PortError);
        assert_eq!(AsyncEventKind::from_raw(9), AsyncEventKind::PortActive);
        assert_eq!(AsyncEventKind::from_raw(8), AsyncEventKind::DeviceFatal);
        assert_eq!(AsyncEventKind::from_raw(18), AsyncEventKind::GidChange);
        // A value libibverbs may add later is carried, not undefined behaviour.
        assert_eq!(AsyncEventKind::from_raw(4242), AsyncEventKind::Other(4242));
        let ev = AsyncEvent {
            device: "mlx5_0".into(),
            port: Some(1),
            kind: AsyncEventKind::PortError,
        };
        assert_eq!(ev.to_string(), "mlx5_0 port 1 IBV_EVENT_PORT_ERR");
    }

    /// On this host (no RDMA in the kernel, or no device) nothing opens, and that is a
    /// reported problem or an empty set, never a panic.
    #[test]
    fn open_all_on_this_host_does_not_panic() {
        let (contexts, problem) = open_all();
        for mut c in contexts {
            let mut out = Vec::new();
            // A freshly opened context has nothing pending, or reports a usable error.
            let _ = c.drain(&mut out);
            assert!(out.iter().all(|e| e.device == c.device()));
        }
        if let Some(p) = problem {
            assert!(!p.is_empty());
        }
    }
}
