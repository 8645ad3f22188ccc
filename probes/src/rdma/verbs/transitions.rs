//! The attributes of an RC queue pair's RESET → INIT → RTR → RTS transitions, written once for
//! the loopback self-test ([`super::selftest`]) and the peer endpoint ([`super::rc`]). Each
//! function returns the `ibv_qp_attr` and the mask of exactly the fields it set, for
//! `ibv_modify_qp`; the callers keep their own error reporting.

use rdma_sys as sys;
use sys::ibv_qp_attr_mask as m;

/// How the RTR transition addresses the remote queue pair's port.
pub(crate) enum Route {
    /// RoCE, or InfiniBand with a GRH: the remote GID, sent from our GID at `sgid_index`.
    Global { dgid: sys::ibv_gid, sgid_index: u8 },
    /// InfiniBand without a GRH: the remote port's LID.
    Lid(u16),
}

/// An attribute struct with only `qp_state` set.
fn only_state(state: sys::ibv_qp_state::Type) -> sys::ibv_qp_attr {
    // SAFETY: an all-zero ibv_qp_attr is valid (integers, and unions of integers).
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = state;
    a
}

/// RESET → INIT on local `port`, allowing `access` (local and remote access flags).
pub(crate) fn init(port: u8, access: sys::ibv_access_flags) -> (sys::ibv_qp_attr, m) {
    let a = sys::ibv_qp_attr {
        pkey_index: 0,
        port_num: port,
        qp_access_flags: access.0,
        ..only_state(sys::ibv_qp_state::IBV_QPS_INIT)
    };
    (
        a,
        m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
    )
}

/// INIT → RTR: receive from remote QP `dest_qpn` (whose first PSN is `rq_psn`) reached over
/// local `port` by `route`, with `path_mtu`; one RDMA READ/atomic in flight, a 0.64 ms RNR
/// NAK timer (12), service level 0.
pub(crate) fn rtr(
    port: u8,
    path_mtu: sys::ibv_mtu::Type,
    dest_qpn: u32,
    rq_psn: u32,
    route: Route,
) -> (sys::ibv_qp_attr, m) {
    let mut a = sys::ibv_qp_attr {
        path_mtu,
        dest_qp_num: dest_qpn,
        rq_psn,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..only_state(sys::ibv_qp_state::IBV_QPS_RTR)
    };
    a.ah_attr.port_num = port;
    a.ah_attr.sl = 0;
    match route {
        Route::Global { dgid, sgid_index } => {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = dgid;
            a.ah_attr.grh.sgid_index = sgid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        Route::Lid(lid) => {
            a.ah_attr.is_global = 0;
            a.ah_attr.dlid = lid;
        }
    }
    (
        a,
        m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER,
    )
}

/// RTR → RTS: send from PSN `sq_psn`, with a transport timeout of 4.096 µs × 2^`timeout` and
/// `retry_cnt` retries; 3 RNR retries, one RDMA READ/atomic in flight.
pub(crate) fn rts(sq_psn: u32, timeout: u8, retry_cnt: u8) -> (sys::ibv_qp_attr, m) {
    let a = sys::ibv_qp_attr {
        sq_psn,
        timeout,
        retry_cnt,
        rnr_retry: 3,
        max_rd_atomic: 1,
        ..only_state(sys::ibv_qp_state::IBV_QPS_RTS)
    };
    (
        a,
        m::IBV_QP_STATE
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_MAX_QP_RD_ATOMIC,
    )
}
