//! Protection domains, completion queues, memory regions and queue pairs: one RAII guard
//! ([`Owned`]) for all four, and constructors that borrow their parents, so the borrow checker
//! (not a comment about declaration order) guarantees that a QP is destroyed before its CQ and
//! PD, an MR before its PD and before the buffer it pins, and every object before its context.

use super::Context;
use rdma_sys as sys;
use std::io;
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};

/// A libibverbs object that must not outlive `'p` (its context, PD, CQ or pinned buffer),
/// freed exactly once on drop by the libibverbs call that matches its constructor.
pub struct Owned<'p, T> {
    ptr: NonNull<T>,
    destroy: unsafe extern "C" fn(*mut T) -> c_int,
    _parents: PhantomData<&'p mut ()>,
}

impl<T> Owned<'_, T> {
    /// Take ownership of what a libibverbs constructor returned; `None` on NULL.
    ///
    /// # Safety
    /// `ptr`, when non-null, must be a live object that `destroy` frees, owned by nobody else,
    /// and every object it depends on must be borrowed for the guard's lifetime by the caller's
    /// signature.
    unsafe fn adopt(ptr: *mut T, destroy: unsafe extern "C" fn(*mut T) -> c_int) -> Option<Self> {
        NonNull::new(ptr).map(|ptr| Self {
            ptr,
            destroy,
            _parents: PhantomData,
        })
    }

    fn as_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }
}

impl<T> Drop for Owned<'_, T> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from the constructor `destroy` matches (see `adopt`) and is freed
        // exactly once, here; the lifetime keeps every parent alive until after this call, and
        // children borrow `self`, so they are gone. A failure cannot be acted upon in `Drop`.
        let _ = unsafe { (self.destroy)(self.ptr.as_ptr()) };
    }
}

/// The errno left by a verbs call that returned NULL; never "success".
pub(crate) fn last_errno() -> io::Error {
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(0) {
        io::Error::from_raw_os_error(libc::EIO)
    } else {
        err
    }
}

/// A protection domain of an open [`Context`].
pub type Pd<'c> = Owned<'c, sys::ibv_pd>;
/// A completion queue of an open [`Context`].
pub type Cq<'c> = Owned<'c, sys::ibv_cq>;
/// A memory region: a buffer pinned and registered in a [`Pd`], exclusively borrowed by it.
pub type Mr<'p> = Owned<'p, sys::ibv_mr>;
/// A queue pair in a [`Pd`] whose work completes on a [`Cq`].
pub type Qp<'p> = Owned<'p, sys::ibv_qp>;

impl<'c> Owned<'c, sys::ibv_pd> {
    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// The errno libibverbs leaves (`ENOMEM`, `EACCES`).
    pub fn alloc(ctx: &'c Context<'_>) -> io::Result<Self> {
        // SAFETY: `ctx.ptr` is an open context, borrowed for `'c`; the PD is freed by
        // `ibv_dealloc_pd`.
        unsafe { Self::adopt(sys::ibv_alloc_pd(ctx.ptr), sys::ibv_dealloc_pd) }
            .ok_or_else(last_errno)
    }
}

impl<'c> Owned<'c, sys::ibv_cq> {
    /// `ibv_create_cq` with room for `entries` completions and no completion channel.
    ///
    /// # Errors
    /// The errno libibverbs leaves.
    pub fn create(ctx: &'c Context<'_>, entries: c_int) -> io::Result<Self> {
        // SAFETY: open context borrowed for `'c`; no channel and no context pointer; freed by
        // `ibv_destroy_cq`.
        unsafe {
            Self::adopt(
                sys::ibv_create_cq(ctx.ptr, entries, ptr::null_mut(), ptr::null_mut(), 0),
                sys::ibv_destroy_cq,
            )
        }
        .ok_or_else(last_errno)
    }

    /// Poll for at most one completion.
    ///
    /// # Errors
    /// The (negated) errno `ibv_poll_cq` returns.
    pub fn poll_one(&self) -> io::Result<Option<sys::ibv_wc>> {
        // SAFETY: an all-zero ibv_wc is a valid value (integers and a null pointer).
        let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
        // SAFETY: live CQ; room for exactly one completion.
        let n = unsafe { sys::ibv_poll_cq(self.as_ptr(), 1, &mut wc) };
        match n {
            0 => Ok(None),
            1 => Ok(Some(wc)),
            n => Err(io::Error::from_raw_os_error(n.saturating_neg())),
        }
    }
}

impl<'p> Owned<'p, sys::ibv_mr> {
    /// `ibv_reg_mr` over the whole of `buf`, which stays borrowed (and so unmoved and
    /// unread by anyone else) until the region is deregistered.
    ///
    /// # Errors
    /// The errno libibverbs leaves: `ENOMEM`/`EPERM`/`EAGAIN` when RLIMIT_MEMLOCK is too low.
    pub fn register(pd: &'p Pd<'_>, buf: &'p mut [u8], access: c_int) -> io::Result<Self> {
        // SAFETY: live PD; `buf` is exclusively borrowed for `'p`, so the pinned bytes stay
        // valid until `ibv_dereg_mr` in `Drop`.
        unsafe {
            Self::adopt(
                sys::ibv_reg_mr(pd.as_ptr(), buf.as_mut_ptr().cast(), buf.len(), access),
                sys::ibv_dereg_mr,
            )
        }
        .ok_or_else(last_errno)
    }

    /// `(lkey, rkey)`.
    pub fn keys(&self) -> (u32, u32) {
        // SAFETY: live MR; lkey/rkey are plain fields set at registration.
        unsafe { ((*self.as_ptr()).lkey, (*self.as_ptr()).rkey) }
    }

    /// The registered bytes `[offset, offset + len)`, when inside the region.
    fn span(&self, offset: usize, len: usize) -> Option<*mut u8> {
        // SAFETY: live MR; `addr`/`length` are what registration recorded (our `buf`).
        let (addr, length) =
            unsafe { ((*self.as_ptr()).addr.cast::<u8>(), (*self.as_ptr()).length) };
        let end = offset.checked_add(len)?;
        (end <= length).then(|| addr.wrapping_add(offset))
    }

    /// The address of byte `offset` as the HCA sees it (for SGEs and RDMA targets), when
    /// inside the region.
    pub fn addr(&self, offset: usize) -> Option<u64> {
        self.span(offset, 0).map(|p| p as u64)
    }

    /// Copy `bytes` into the region at `offset`. Only while no work request that touches
    /// these bytes is outstanding. `false` when out of bounds.
    pub fn write(&mut self, offset: usize, bytes: &[u8]) -> bool {
        let Some(dst) = self.span(offset, bytes.len()) else {
            return false;
        };
        // SAFETY: `dst..dst+len` lies inside the buffer this MR borrows exclusively; `bytes`
        // is a separate allocation, so the ranges do not overlap.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        true
    }

    /// Copy `len` bytes out of the region at `offset` (after the completions that wrote
    /// them); `None` when out of bounds.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let src = self.span(offset, len)?;
        // SAFETY: inside the borrowed buffer, which is initialised (it is a `&mut [u8]`).
        Some(unsafe { std::slice::from_raw_parts(src, len) }.to_vec())
    }

    /// Copy `len` bytes out of the region at `offset` while a remote peer may be writing into
    /// it: volatile reads, so the compiler assumes nothing about the bytes. `None` when out of
    /// bounds.
    pub fn read_volatile(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let src = self.span(offset, len)?;
        let bytes = (0..len)
            // SAFETY: `src + i` lies inside the region (`span` checked it), in the buffer this
            // MR borrows; a volatile read of a `u8` is valid whatever the HCA wrote there.
            .map(|i| unsafe { ptr::read_volatile(src.add(i)) })
            .collect();
        Some(bytes)
    }
}

impl<'p> Owned<'p, sys::ibv_qp> {
    /// An RC queue pair whose sends and receives complete on `cq`, with room for four work
    /// requests of one SGE each way.
    ///
    /// # Errors
    /// The errno libibverbs leaves.
    pub fn create_rc(pd: &'p Pd<'_>, cq: &'p Cq<'_>) -> io::Result<Self> {
        Self::create_rc_with(pd, cq, 4, 4)
    }

    /// An RC queue pair like [`Self::create_rc`] with room for `send_wr` sends and `recv_wr`
    /// receives (one SGE each); only signalled sends complete (`sq_sig_all` 0).
    ///
    /// # Errors
    /// The errno libibverbs leaves (`EINVAL` for more work requests than the device allows).
    pub fn create_rc_with(
        pd: &'p Pd<'_>,
        cq: &'p Cq<'_>,
        send_wr: u32,
        recv_wr: u32,
    ) -> io::Result<Self> {
        // SAFETY: an all-zero ibv_qp_init_attr is valid (null pointers, zero caps).
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.as_ptr();
        init.recv_cq = cq.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = send_wr;
        init.cap.max_recv_wr = recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: live PD and CQ, both borrowed for `'p`; `init` fully initialised; freed by
        // `ibv_destroy_qp`, which flushes outstanding work requests.
        unsafe {
            Self::adopt(
                sys::ibv_create_qp(pd.as_ptr(), &mut init),
                sys::ibv_destroy_qp,
            )
        }
        .ok_or_else(last_errno)
    }

    /// The QP number peers address.
    pub fn num(&self) -> u32 {
        // SAFETY: live QP; qp_num is set by ibv_create_qp.
        unsafe { (*self.as_ptr()).qp_num }
    }

    /// `ibv_modify_qp`.
    ///
    /// # Errors
    /// The errno the provider returns.
    pub fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: sys::ibv_qp_attr_mask,
    ) -> io::Result<()> {
        let mask = c_int::try_from(mask.0).unwrap_or(c_int::MAX);
        // SAFETY: live QP, `attr` a valid, fully initialised attribute struct.
        let rc = unsafe { sys::ibv_modify_qp(self.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Post one receive of `len` bytes at `offset` of `mr`.
    ///
    /// # Errors
    /// `EINVAL` when the span is outside `mr`, else the errno `ibv_post_recv` returns.
    pub fn post_recv(&self, wr_id: u64, mr: &Mr<'_>, offset: usize, len: u32) -> io::Result<()> {
        let mut sge = sge(mr, offset, len)?;
        // SAFETY: an all-zero ibv_recv_wr is valid; fields set below.
        let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the WR and its SGE live across the call; the target is registered.
        let rc = unsafe { sys::ibv_post_recv(self.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Post one signalled send of `len` bytes at `offset` of `mr`: a SEND, or an RDMA WRITE
    /// when `remote` gives the target address and rkey.
    ///
    /// # Errors
    /// `EINVAL` when the span is outside `mr`, else the errno `ibv_post_send` returns.
    pub fn post_send(
        &self,
        wr_id: u64,
        mr: &Mr<'_>,
        offset: usize,
        len: u32,
        remote: Option<(u64, u32)>,
    ) -> io::Result<()> {
        let mut sge = sge(mr, offset, len)?;
        // SAFETY: an all-zero ibv_send_wr is valid (null next, no flags).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
        if let Some((remote_addr, rkey)) = remote {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; `wr` and its SGE outlive the call; the SGE is in a registered MR.
        let rc = unsafe { sys::ibv_post_send(self.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

fn sge(mr: &Mr<'_>, offset: usize, len: u32) -> io::Result<sys::ibv_sge> {
    let inside = usize::try_from(len)
        .ok()
        .and_then(|n| mr.span(offset, n))
        .is_some();
    match mr.addr(offset) {
        Some(addr) if inside => Ok(sys::ibv_sge {
            addr,
            length: len,
            lkey: mr.keys().0,
        }),
        _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    }
}

/// `ibv_query_gid`.
///
/// # Errors
/// The errno the provider returns (`EINVAL` for an index outside the table).
pub fn query_gid(ctx: &Context<'_>, port: u8, index: u8) -> io::Result<sys::ibv_gid> {
    // SAFETY: an all-zero ibv_gid is valid.
    let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: open context, valid out-pointer.
    let rc = unsafe { sys::ibv_query_gid(ctx.ptr, port, c_int::from(index), &mut gid) };
    if rc != 0 {
        return Err(last_errno());
    }
    Ok(gid)
}
