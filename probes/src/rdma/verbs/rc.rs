//! One RC queue pair towards another node, for the peer measurements (`rdma::peer`): a
//! registered buffer, a QP moved to RTS against the remote side's GID/LID and QPN, and
//! signalled RDMA WRITEs that are timed from post to completion.
//!
//! RC rather than UD: RDMA WRITE (the bandwidth burst) exists only on connected transports,
//! and an RC WRITE completes only after the responder's HCA acknowledged it, so post to
//! completion is one fabric round trip that the responder's CPU takes no part in.
//!
//! All verbs objects live inside [`with_endpoint`] as the [`Owned`](super::objects::Owned)
//! guards of `objects`, which borrow what they depend on: the borrow checker keeps the
//! reverse order of freeing on every path, including errors and panics.

use super::objects::{Cq, Mr, Pd, Qp, query_gid};
use super::transitions::{self, Route};
use super::{DeviceList, mtu_enum, wc_status_str};
use rdma_sys as sys;
use std::io;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// What the other side needs to reach this endpoint (exchanged over the side channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndpointInfo {
    /// The GID (network byte order) the remote side addresses; all zero on InfiniBand
    /// without GRH.
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    /// Active MTU of the port in bytes (the path MTU is the smaller of both sides').
    pub mtu: u32,
    /// Address and rkey of the registered buffer, and its length.
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
}

/// A failed verbs step: which one, the errno when there is one, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RcError {
    pub step: &'static str,
    pub errno: Option<i32>,
    /// The work completion status when a WRITE completed with an error.
    pub wc_status: Option<u32>,
    pub message: String,
}

impl RcError {
    fn os(step: &'static str, err: &io::Error) -> Self {
        let errno = err.raw_os_error().filter(|&e| e != 0);
        Self {
            step,
            errno,
            wc_status: None,
            message: format!("{step}: {err}"),
        }
    }

    fn other(step: &'static str, message: String) -> Self {
        Self {
            step,
            errno: None,
            wc_status: None,
            message,
        }
    }

    /// The remote side did not answer in time: our deadline passed, or the HCA gave up
    /// after its retries (`IBV_WC_RETRY_EXC_ERR`, `IBV_WC_RNR_RETRY_EXC_ERR`).
    pub fn is_timeout(&self) -> bool {
        self.errno == Some(libc::ETIMEDOUT)
            || matches!(
                self.wc_status,
                Some(sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR)
                    | Some(sys::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR)
            )
    }

    /// A WRITE completed with an error status (other than a timeout).
    pub fn is_completion_error(&self) -> bool {
        self.wc_status.is_some() && !self.is_timeout()
    }
}

/// A connected (or connectable) RC endpoint; only exists inside [`with_endpoint`].
pub struct Endpoint<'a> {
    cq: &'a Cq<'a>,
    /// Declared before `mr`, so it is dropped first: destroying the QP flushes its work
    /// requests before the region they target is deregistered.
    qp: Qp<'a>,
    mr: Mr<'a>,
    /// Bytes of the registered buffer.
    len: usize,
    port: u8,
    gid_index: Option<u8>,
    local: EndpointInfo,
    /// Work requests posted whose completion has not been polled yet.
    outstanding: u32,
    max_outstanding: u32,
}

/// Where on the local port to create the endpoint.
#[derive(Debug, Clone)]
pub struct EndpointSpec<'s> {
    pub device: &'s str,
    pub port: u8,
    /// GID index to source from (RoCE, or IB with GRH); `None`: address by LID.
    pub gid_index: Option<u8>,
    /// Size of the registered buffer.
    pub buf_len: usize,
    /// Bound on WRITEs in flight (the bandwidth burst's queue depth).
    pub max_outstanding: u32,
}

/// Open `spec.device`, create PD, CQ, buffer + MR and an RC QP in INIT, run `f` on it, and
/// free everything. The QP is connected by [`Endpoint::connect`].
///
/// # Errors
/// The failing step (`get_device_list`, `open_device`, `query_port`, `query_gid`,
/// `alloc_pd`, `create_cq`, `reg_mr`, `create_qp`, `modify_qp INIT`) and its errno.
pub fn with_endpoint<R>(
    spec: &EndpointSpec<'_>,
    f: impl FnOnce(&mut Endpoint<'_>) -> R,
) -> Result<R, RcError> {
    let list = DeviceList::new().map_err(|e| RcError::os("get_device_list", &e))?;
    let device = list
        .iter()
        .find(|d| d.name() == spec.device)
        .ok_or_else(|| {
            RcError::other(
                "open_device",
                format!("open_device: libibverbs does not list {}", spec.device),
            )
        })?;
    let ctx = device.open().map_err(|e| RcError::os("open_device", &e))?;
    let attr = ctx
        .query_port(spec.port)
        .map_err(|e| RcError::os("query_port", &e))?;
    if attr.state != crate::rdma::PortState::Active {
        return Err(RcError::other(
            "query_port",
            format!(
                "query_port: {} port {} is {}; the data path needs an ACTIVE port",
                spec.device, spec.port, attr.state
            ),
        ));
    }
    let mut gid = [0u8; 16];
    if let Some(idx) = spec.gid_index {
        let raw = query_gid(&ctx, spec.port, idx).map_err(|e| RcError::os("query_gid", &e))?;
        // SAFETY: `raw` is plain 16 bytes; reading the byte view of the union is valid.
        gid = unsafe { raw.raw };
    }

    let len = spec.buf_len.max(64);
    let mut buf = vec![0u8; len];
    // What the remote side's WRITEs target (ibv_reg_mr registers the buffer at this address).
    let addr = buf.as_ptr() as u64;

    let pd = Pd::alloc(&ctx).map_err(|e| RcError::os("alloc_pd", &e))?;
    let depth = spec.max_outstanding.clamp(1, 64);
    let cq_len = c_int::try_from(depth * 2 + 8).unwrap_or(136);
    let cq = Cq::create(&ctx, cq_len).map_err(|e| RcError::os("create_cq", &e))?;
    let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    let access_int = c_int::try_from(access.0).unwrap_or(0);
    let mr = Mr::register(&pd, &mut buf, access_int).map_err(|e| RcError::os("reg_mr", &e))?;
    let (_, rkey) = mr.keys();
    let qp =
        Qp::create_rc_with(&pd, &cq, depth + 2, 1).map_err(|e| RcError::os("create_qp", &e))?;
    let qpn = qp.num();

    let (mut a, mask) = transitions::init(spec.port, access);
    modify(&qp, "modify_qp INIT", &mut a, mask)?;

    let local = EndpointInfo {
        gid,
        qpn,
        psn: initial_psn(qpn),
        lid: attr.lid,
        mtu: attr.active_mtu,
        addr,
        rkey,
        len: u32::try_from(len).unwrap_or(u32::MAX),
    };
    let mut ep = Endpoint {
        cq: &cq,
        qp,
        mr,
        len,
        port: spec.port,
        gid_index: spec.gid_index,
        local,
        outstanding: 0,
        max_outstanding: depth,
    };
    let out = f(&mut ep);
    // The QP and MR first (`ep`'s fields, in that order); the CQ, PD, buffer and context
    // follow in reverse order of declaration.
    drop(ep);
    Ok(out)
}

/// A 24-bit starting PSN that differs between sessions (not a secret: RC checks it only
/// to drop stale packets).
fn initial_psn(qpn: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (nanos ^ qpn.rotate_left(8)) & 0x00ff_ffff
}

fn modify(
    qp: &Qp<'_>,
    step: &'static str,
    attr: &mut sys::ibv_qp_attr,
    mask: sys::ibv_qp_attr_mask,
) -> Result<(), RcError> {
    qp.modify(attr, mask).map_err(|e| RcError::os(step, &e))
}

impl Endpoint<'_> {
    /// What the remote side needs to connect to us.
    pub fn local(&self) -> EndpointInfo {
        self.local
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// INIT → RTR → RTS towards `remote`.
    ///
    /// # Errors
    /// `modify_qp RTR`/`modify_qp RTS` with the provider's errno (e.g. a GID the port cannot
    /// route to).
    pub fn connect(&mut self, remote: &EndpointInfo) -> Result<(), RcError> {
        let route = match self.gid_index {
            Some(sgid_index) => Route::Global {
                dgid: sys::ibv_gid { raw: remote.gid },
                sgid_index,
            },
            None => Route::Lid(remote.lid),
        };
        let path_mtu = mtu_enum(self.local.mtu.min(remote.mtu).min(4096));
        let (mut a, mask) = transitions::rtr(self.port, path_mtu, remote.qpn, remote.psn, route);
        modify(&self.qp, "modify_qp RTR", &mut a, mask)?;
        // ~268 ms transport timeout (4.096 µs × 2^16), 7 retries (perftest and NCCL use 7):
        // a lost packet is retried rather than failing the session, and a dead path still
        // fails in about two seconds, inside the default `peers.timeout`.
        let (mut a, mask) = transitions::rts(self.local.psn, 16, 7);
        modify(&self.qp, "modify_qp RTS", &mut a, mask)
    }

    /// Copy `data` into the local buffer at `offset` (clipped to the buffer).
    pub fn fill(&mut self, offset: usize, data: &[u8]) {
        let Some(room) = self.len.checked_sub(offset) else {
            return;
        };
        let n = data.len().min(room);
        // Clipped to the region, so the MR cannot refuse it. No WRITE that reads these bytes
        // is in flight when the caller fills them (every post is waited for).
        self.mr.write(offset, &data[..n]);
    }

    /// A copy of `len` bytes of the local buffer at `offset` (clipped to the buffer). The
    /// remote side may write into it at any time; the copy is volatile so the compiler
    /// assumes nothing about its contents.
    pub fn snapshot(&self, offset: usize, len: usize) -> Vec<u8> {
        let Some(room) = self.len.checked_sub(offset) else {
            return Vec::new();
        };
        let n = len.min(room);
        // Clipped to the region, so never `None`.
        self.mr.read_volatile(offset, n).unwrap_or_default()
    }

    fn post_write(
        &mut self,
        wr_id: u64,
        local_off: usize,
        len: usize,
        remote: &EndpointInfo,
        remote_off: u64,
    ) -> Result<(), RcError> {
        if local_off.checked_add(len).is_none_or(|end| end > self.len)
            || remote_off
                .checked_add(len as u64)
                .is_none_or(|end| end > u64::from(remote.len))
        {
            return Err(RcError::other(
                "post_send",
                format!(
                    "post_send: WRITE of {len} bytes at {local_off}/{remote_off} is outside the \
                     buffers ({} local, {} remote)",
                    self.len, remote.len
                ),
            ));
        }
        let length = u32::try_from(len).unwrap_or(u32::MAX);
        let target = (remote.addr.wrapping_add(remote_off), remote.rkey);
        self.qp
            .post_send(wr_id, &self.mr, local_off, length, Some(target))
            .map_err(|e| RcError::os("post_send RDMA WRITE", &e))?;
        self.outstanding += 1;
        Ok(())
    }

    /// Poll one completion; `Ok(None)` when the CQ is empty.
    fn poll_one(&mut self) -> Result<Option<u64>, RcError> {
        let Some(wc) = self.cq.poll_one().map_err(|e| RcError::os("poll_cq", &e))? else {
            return Ok(None);
        };
        self.outstanding = self.outstanding.saturating_sub(1);
        if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
            return Err(RcError {
                step: "poll_cq",
                errno: None,
                wc_status: Some(wc.status),
                message: format!(
                    "poll_cq: RDMA WRITE completed with error: {} (status {}, vendor_err {:#x})",
                    wc_status_str(wc.status),
                    wc.status,
                    wc.vendor_err
                ),
            });
        }
        Ok(Some(wc.wr_id))
    }

    /// Wait for one completion until `deadline`: spin for the first 50 µs (hardware
    /// completes in microseconds), then sleep between polls for an eighth of the time waited
    /// so far (20 µs to 1 ms): a slow path is timed to within ~12% without burning a core,
    /// and a software provider (rxe) gets the CPU it needs to make progress.
    fn wait_one(&mut self, deadline: Instant) -> Result<u64, RcError> {
        let start = Instant::now();
        let spin_until = start + Duration::from_micros(50);
        loop {
            if let Some(id) = self.poll_one()? {
                return Ok(id);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RcError {
                    step: "poll_cq",
                    errno: Some(libc::ETIMEDOUT),
                    wc_status: None,
                    message: format!(
                        "poll_cq: errno {} (ETIMEDOUT): no RDMA WRITE completion before the \
                         deadline; the peer's port does not answer",
                        libc::ETIMEDOUT
                    ),
                });
            }
            if now < spin_until {
                std::hint::spin_loop();
            } else {
                let nap = (now - start) / 8;
                std::thread::sleep(nap.clamp(Duration::from_micros(20), Duration::from_millis(1)));
            }
        }
    }

    /// One signalled RDMA WRITE of `len` bytes from `local_off` to the remote buffer at
    /// `remote_off`; the time from post to its completion (the responder HCA's ACK).
    ///
    /// # Errors
    /// Posting failed, the completion carried an error, or none came before `deadline`.
    pub fn write(
        &mut self,
        local_off: usize,
        len: usize,
        remote: &EndpointInfo,
        remote_off: u64,
        deadline: Instant,
    ) -> Result<Duration, RcError> {
        let start = Instant::now();
        self.post_write(1, local_off, len, remote, remote_off)?;
        self.wait_one(deadline)?;
        Ok(start.elapsed())
    }

    /// RDMA WRITEs of `len` bytes, up to the queue depth in flight, until `duration` has
    /// passed; then wait for the rest. Returns the bytes completed and the time from the
    /// first post to the last completion.
    ///
    /// # Errors
    /// As [`Endpoint::write`].
    pub fn write_stream(
        &mut self,
        local_off: usize,
        len: usize,
        remote: &EndpointInfo,
        remote_off: u64,
        duration: Duration,
        deadline: Instant,
    ) -> Result<(u64, Duration), RcError> {
        let start = Instant::now();
        let stop = start + duration;
        let mut completed: u64 = 0;
        let mut wr_id: u64 = 16;
        while Instant::now() < stop {
            while self.outstanding < self.max_outstanding {
                wr_id += 1;
                self.post_write(wr_id, local_off, len, remote, remote_off)?;
            }
            self.wait_one(deadline)?;
            completed += 1;
            while self.poll_one()?.is_some() {
                completed += 1;
            }
        }
        while self.outstanding > 0 {
            self.wait_one(deadline)?;
            completed += 1;
        }
        Ok((completed.saturating_mul(len as u64), start.elapsed()))
    }

    /// The port this endpoint uses (for messages).
    pub fn port(&self) -> u8 {
        self.port
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_enum_rounds_down() {
        assert_eq!(mtu_enum(1500), sys::ibv_mtu::IBV_MTU_1024);
        assert_eq!(mtu_enum(4096), sys::ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_enum(0), sys::ibv_mtu::IBV_MTU_256);
    }

    #[test]
    fn timeouts_are_told_apart_from_other_completion_errors() {
        let t = RcError {
            step: "poll_cq",
            errno: None,
            wc_status: Some(sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
            message: String::new(),
        };
        assert!(t.is_timeout() && !t.is_completion_error());
        let a = RcError {
            wc_status: Some(sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            ..t.clone()
        };
        assert!(!a.is_timeout() && a.is_completion_error());
        let d = RcError {
            errno: Some(libc::ETIMEDOUT),
            wc_status: None,
            ..t
        };
        assert!(d.is_timeout());
    }

    /// Without RDMA on this host: a named step fails, nothing panics.
    #[test]
    fn no_such_device_fails_at_a_named_step() {
        let spec = EndpointSpec {
            device: "fabricgate-test-no-such-dev",
            port: 1,
            gid_index: Some(1),
            buf_len: 4096,
            max_outstanding: 4,
        };
        let e = with_endpoint(&spec, |_| ()).unwrap_err();
        assert!(
            e.step == "get_device_list" || e.step == "open_device",
            "{e:?}"
        );
        assert!(e.message.starts_with(e.step), "{e:?}");
    }
}
