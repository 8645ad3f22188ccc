//! The loopback RC data-path self-test: on one port, two RC queue pairs connected to each
//! other, an RDMA WRITE and a SEND of a known pattern, the bytes verified and the round trip
//! timed. A port can be ACTIVE while this fails (no usable GID, RLIMIT_MEMLOCK too low to pin
//! memory, a provider that cannot move data), which is exactly what it is for.
//!
//! Every verbs object is a guard from [`super::objects`] whose constructor borrows its
//! parents, so the borrow checker frees QPs before the CQ, the MR before the PD and the
//! buffer, and everything on every path.

use super::objects::{Cq, Mr, Pd, Qp, query_gid};
use super::transitions::{self, Route};
use super::{Context, DeviceList, mtu_enum, wc_status_str};
use crate::rdma::{DeviceReport, GidType, LinkLayer, PortReport, RdmaReport, SelftestResult};
use rdma_sys as sys;
use std::io;
use std::os::raw::c_int;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// When the prober runs the self-test (`rdma.selftest` in the requirements file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelftestSchedule {
    Off,
    /// Each port when it is first seen up (and after it comes back up), and again on every
    /// probe while its last test failed; a passing result is kept and reported.
    #[default]
    OnStart,
    /// Every N probes (N >= 1), plus the `OnStart` cases.
    Every(u32),
}

impl FromStr for SelftestSchedule {
    type Err = String;

    /// `off`, `on-start`, `every N probes` (or `every N`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let words: Vec<&str> = s.split_whitespace().collect();
        let bad =
            || format!("{s:?} is not a schedule; use \"off\", \"on-start\" or \"every N probes\"");
        match words.as_slice() {
            ["off"] => Ok(Self::Off),
            ["on-start"] => Ok(Self::OnStart),
            ["every", n] | ["every", n, "probes" | "probe"] => match n.parse::<u32>() {
                Ok(n) if n >= 1 => Ok(Self::Every(n)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

/// Default bound on one port's test, QP setup to the last completion.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Size of each region of the test buffer (WRITE source/target, SEND source/target).
const REGION: usize = 256;

/// Which step failed, its errno and what to do.
struct StepError {
    step: &'static str,
    errno: Option<i32>,
    message: String,
}

impl StepError {
    fn os(step: &'static str, err: &io::Error) -> Self {
        let errno = err.raw_os_error().filter(|&e| e != 0);
        Self {
            step,
            errno,
            message: describe(step, errno, err),
        }
    }

    fn other(step: &'static str, message: String) -> Self {
        Self {
            step,
            errno: None,
            message,
        }
    }
}

/// `errno 12 (ENOMEM): ...` with advice for the cases an operator can fix.
fn describe(step: &str, errno: Option<i32>, err: &io::Error) -> String {
    let Some(e) = errno else {
        return format!("{step}: {err}");
    };
    let head = format!("{step}: errno {e} ({})", errno_name(e));
    match (step, e) {
        ("reg_mr", libc::ENOMEM | libc::EPERM | libc::EAGAIN) => format!(
            "{head}: RLIMIT_MEMLOCK too low ({}); raise the memlock limit (ulimit -l, \
             LimitMEMLOCK, container runtime) or add IPC_LOCK",
            memlock_limit()
        ),
        (_, libc::EACCES | libc::EPERM) => format!(
            "{head}: permission denied; give the agent access to /dev/infiniband and IPC_LOCK"
        ),
        _ => format!("{head}: {err}"),
    }
}

fn errno_name(e: i32) -> &'static str {
    match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ENETDOWN => "ENETDOWN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        _ => "?",
    }
}

/// The soft RLIMIT_MEMLOCK as text, for the reg_mr advice.
fn memlock_limit() -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer for getrlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        return "limit unknown".into();
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        "memlock unlimited".into()
    } else {
        format!("memlock {} bytes", lim.rlim_cur)
    }
}

/// How to address our own port: a GID index (RoCE, or IB with GRH) or the LID.
#[derive(Debug, Clone, Copy)]
struct Address {
    gid_index: Option<u8>,
    lid: u16,
}

/// Pick the GID the loopback uses: a RoCE v2 GID (IPv4-mapped first, as NCCL prefers), else
/// any other; InfiniBand uses the LID and needs none.
fn pick_gid(port: &PortReport) -> Option<u32> {
    let roce2 = |g: &&crate::rdma::Gid| g.gid_type == Some(GidType::RoceV2);
    let v4 = |g: &&crate::rdma::Gid| g.gid.starts_with("0000:0000:0000:0000:0000:ffff:");
    port.gids
        .iter()
        .filter(roce2)
        .find(v4)
        .or_else(|| port.gids.iter().find(roce2))
        .or_else(|| port.gids.first())
        .map(|g| g.index)
}

/// Run the test on one port of an open context. Never panics; bounded by `timeout` once the
/// queue pairs exist (setup calls are synchronous and short).
fn run_port(ctx: &Context<'_>, port: &PortReport, timeout: Duration) -> SelftestResult {
    let started = Instant::now();
    let mut gid_index = None;
    let outcome = run_port_inner(ctx, port, timeout, &mut gid_index);
    let duration_us = Some(started.elapsed().as_secs_f64() * 1e6);
    match outcome {
        Ok(latency) => SelftestResult {
            ok: true,
            failed_step: None,
            errno: None,
            message: None,
            latency_us: Some(latency.as_secs_f64() * 1e6),
            gid_index,
            duration_us,
        },
        Err(e) => SelftestResult {
            ok: false,
            failed_step: Some(e.step.to_owned()),
            errno: e.errno,
            message: Some(e.message),
            latency_us: None,
            gid_index,
            duration_us,
        },
    }
}

fn run_port_inner(
    ctx: &Context<'_>,
    port: &PortReport,
    timeout: Duration,
    gid_out: &mut Option<u32>,
) -> Result<Duration, StepError> {
    let num = u8::try_from(port.port)
        .map_err(|_| StepError::other("query_port", format!("port {} out of range", port.port)))?;
    let attr = ctx
        .query_port(num)
        .map_err(|e| StepError::os("query_port", &e))?;
    if attr.state != crate::rdma::PortState::Active {
        return Err(StepError::other(
            "query_port",
            format!(
                "query_port: port is {} (phys {}); the data path needs an ACTIVE port",
                attr.state, attr.phys_state
            ),
        ));
    }
    let addr = address(port, &attr, gid_out)?;

    // Each guard borrows what it depends on: the borrow checker frees them in order.
    let mut buf = vec![0u8; 4 * REGION];
    let pd = Pd::alloc(ctx).map_err(|e| StepError::os("alloc_pd", &e))?;
    let cq = Cq::create(ctx, 16).map_err(|e| StepError::os("create_cq", &e))?;
    let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    let access = c_int::try_from(access.0).unwrap_or(0);
    let mut mr = Mr::register(&pd, &mut buf, access).map_err(|e| StepError::os("reg_mr", &e))?;
    let qp_a = Qp::create_rc(&pd, &cq).map_err(|e| StepError::os("create_qp", &e))?;
    let qp_b = Qp::create_rc(&pd, &cq).map_err(|e| StepError::os("create_qp", &e))?;
    for (me, peer) in [(&qp_a, qp_b.num()), (&qp_b, qp_a.num())] {
        connect(me, peer, num, &attr, addr, ctx)?;
    }
    // Checked: a timeout too large for the clock waits "forever" instead of panicking.
    let now = Instant::now();
    let deadline = now
        .checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(86_400));
    write_and_send(&qp_a, &qp_b, &cq, &mut mr, deadline)
}

/// How to reach our own port: a RoCE port by a GID (recorded in `gid_out`), an InfiniBand
/// port by its LID.
fn address(
    port: &PortReport,
    attr: &crate::rdma::VerbsPort,
    gid_out: &mut Option<u32>,
) -> Result<Address, StepError> {
    if attr.link_layer != LinkLayer::Ethernet {
        return Ok(Address {
            gid_index: None,
            lid: attr.lid,
        });
    }
    let idx = pick_gid(port).ok_or_else(|| {
        StepError::other(
            "select_gid",
            "select_gid: the port has no GID; RoCE needs an IP address on the port's netdev".into(),
        )
    })?;
    *gid_out = Some(idx);
    let gid_index = u8::try_from(idx).map_err(|_| {
        StepError::other("select_gid", format!("select_gid: GID index {idx} > 255"))
    })?;
    Ok(Address {
        gid_index: Some(gid_index),
        lid: 0,
    })
}

/// Over two connected QPs: an RDMA WRITE of region 0 (via A) into region 1 (by rkey), timed,
/// then a SEND of region 2 into a receive on B at region 3; both targets verified. Returns
/// the WRITE's round trip.
fn write_and_send(
    qp_a: &Qp<'_>,
    qp_b: &Qp<'_>,
    cq: &Cq<'_>,
    mr: &mut Mr<'_>,
    deadline: Instant,
) -> Result<Duration, StepError> {
    // Known patterns: distinct per region so a misdirected write cannot pass.
    let write_src: Vec<u8> = (0..REGION).map(|i| (i as u8) ^ 0xA5).collect();
    let send_src: Vec<u8> = (0..REGION)
        .map(|i| (i as u8).wrapping_mul(7) ^ 0x3C)
        .collect();
    if !(mr.write(0, &write_src) && mr.write(2 * REGION, &send_src)) {
        return Err(StepError::other(
            "verify",
            "verify: buffer too small".into(),
        ));
    }
    let len = REGION as u32;
    let (_, rkey) = mr.keys();
    let target = mr
        .addr(REGION)
        .ok_or_else(|| StepError::other("verify", "verify: buffer too small".into()))?;

    qp_b.post_recv(WR_RECV, mr, 3 * REGION, len)
        .map_err(|e| StepError::os("post_recv", &e))?;

    // The WRITE's completion needs the responder's ACK: post-to-completion is a round trip.
    let write_start = Instant::now();
    qp_a.post_send(WR_WRITE, mr, 0, len, Some((target, rkey)))
        .map_err(|e| StepError::os("post_send RDMA WRITE", &e))?;
    poll_for(cq, &[(WR_WRITE, "RDMA WRITE")], deadline)?;
    let latency = write_start.elapsed();

    qp_a.post_send(WR_SEND, mr, 2 * REGION, len, None)
        .map_err(|e| StepError::os("post_send SEND", &e))?;
    // On loopback the receive side may complete before the sender sees its ACK.
    poll_for(cq, &[(WR_SEND, "SEND"), (WR_RECV, "RECV")], deadline)?;

    // All completions are in: the HCA is done with the buffer.
    for (offset, want, what) in [
        (
            REGION,
            &write_src,
            "RDMA WRITE completed but the target holds",
        ),
        (
            3 * REGION,
            &send_src,
            "SEND completed but the receive buffer holds",
        ),
    ] {
        let got = mr.read(offset, REGION).unwrap_or_default();
        if got != *want {
            return Err(StepError::other(
                "verify",
                format!(
                    "verify: {what} different bytes (first difference at offset {})",
                    first_diff(&got, want)
                ),
            ));
        }
    }
    Ok(latency)
}

const WR_WRITE: u64 = 1;
const WR_SEND: u64 = 2;
const WR_RECV: u64 = 3;

fn first_diff(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(0)
}

/// RESET → INIT → RTR → RTS towards `peer` on our own port.
fn connect(
    qp: &Qp<'_>,
    peer: u32,
    port: u8,
    attr: &crate::rdma::VerbsPort,
    addr: Address,
    ctx: &Context<'_>,
) -> Result<(), StepError> {
    let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    let (mut a, mask) = transitions::init(port, access);
    qp.modify(&mut a, mask)
        .map_err(|e| StepError::os("modify_qp INIT", &e))?;

    let route = match addr.gid_index {
        Some(sgid_index) => Route::Global {
            dgid: query_gid(ctx, port, sgid_index).map_err(|e| StepError::os("query_gid", &e))?,
            sgid_index,
        },
        None => Route::Lid(addr.lid),
    };
    // 1024 is safe on every port (rxe's active MTU follows the netdev's).
    let path_mtu = sys::ibv_mtu::IBV_MTU_1024.min(mtu_enum(attr.active_mtu));
    let (mut a, mask) = transitions::rtr(port, path_mtu, peer, 0, route);
    qp.modify(&mut a, mask)
        .map_err(|e| StepError::os("modify_qp RTR", &e))?;

    // ~67 ms transport timeout, 3 retries: a dead path fails inside the 2 s default bound.
    let (mut a, mask) = transitions::rts(0, 14, 3);
    qp.modify(&mut a, mask)
        .map_err(|e| StepError::os("modify_qp RTS", &e))
}

/// Poll the CQ until every completion in `want` (wr_id, name) has arrived, in any order.
fn poll_for(cq: &Cq<'_>, want: &[(u64, &str)], deadline: Instant) -> Result<(), StepError> {
    let mut missing: Vec<(u64, &str)> = want.to_vec();
    let mut empty_polls = 0u32;
    while !missing.is_empty() {
        if let Some(wc) = cq.poll_one().map_err(|e| StepError::os("poll_cq", &e))? {
            let what = match wc.wr_id {
                WR_WRITE => "RDMA WRITE",
                WR_SEND => "SEND",
                WR_RECV => "RECV",
                _ => "unknown work request",
            };
            if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
                return Err(StepError::other(
                    "poll_cq",
                    format!(
                        "poll_cq: {what} completed with error: {} (status {}, vendor_err {:#x})",
                        wc_status_str(wc.status),
                        wc.status,
                        wc.vendor_err
                    ),
                ));
            }
            missing.retain(|(id, _)| *id != wc.wr_id);
            continue;
        }
        if Instant::now() >= deadline {
            let names: Vec<&str> = missing.iter().map(|(_, n)| *n).collect();
            return Err(StepError {
                step: "poll_cq",
                errno: Some(libc::ETIMEDOUT),
                message: format!(
                    "poll_cq: errno {} (ETIMEDOUT): no {} completion before the deadline; \
                     the port is up but does not move data",
                    libc::ETIMEDOUT,
                    names.join(" or ")
                ),
            });
        }
        // Spin briefly (completions on hardware take microseconds), then yield the CPU: a
        // software provider (rxe) needs it to make progress.
        empty_polls += 1;
        if empty_polls > 200 {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::hint::spin_loop();
        }
    }
    Ok(())
}

/// Run the test on every port `select` picks, storing results in `PortReport.selftest`.
/// Devices are opened afresh (the verbs probe closes its contexts); a device that cannot be
/// opened fails each selected port at `open_device`.
pub fn run(
    report: &mut RdmaReport,
    select: &mut dyn FnMut(&DeviceReport, &PortReport) -> bool,
    timeout: Duration,
) {
    let chosen: Vec<(usize, Vec<usize>)> = report
        .devices
        .iter()
        .enumerate()
        .map(|(d, dev)| {
            let ports = dev
                .ports
                .iter()
                .enumerate()
                .filter(|(_, p)| select(dev, p))
                .map(|(i, _)| i)
                .collect::<Vec<_>>();
            (d, ports)
        })
        .filter(|(_, ports)| !ports.is_empty())
        .collect();
    if chosen.is_empty() {
        return;
    }
    let list = DeviceList::new();
    for (d, ports) in chosen {
        let dev = &mut report.devices[d];
        let failed = |step: &'static str, err: &io::Error| {
            let e = StepError::os(step, err);
            SelftestResult {
                ok: false,
                failed_step: Some(e.step.to_owned()),
                errno: e.errno,
                message: Some(e.message),
                ..SelftestResult::default()
            }
        };
        let opened = match &list {
            Err(e) => Err(failed("get_device_list", e)),
            Ok(list) => match list.iter().find(|x| x.name() == dev.name) {
                None => Err(SelftestResult {
                    ok: false,
                    failed_step: Some("open_device".into()),
                    message: Some(format!(
                        "open_device: libibverbs does not list {}; install its provider \
                         library (ibverbs-providers)",
                        dev.name
                    )),
                    ..SelftestResult::default()
                }),
                Some(device) => device.open().map_err(|e| failed("open_device", &e)),
            },
        };
        match opened {
            Ok(ctx) => {
                for i in ports {
                    let result = run_port(&ctx, &dev.ports[i], timeout);
                    dev.ports[i].selftest = Some(result);
                }
            }
            Err(result) => {
                for i in ports {
                    dev.ports[i].selftest = Some(result.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::Gid;

    #[test]
    fn schedules_parse_and_reject_nonsense() {
        assert_eq!("off".parse(), Ok(SelftestSchedule::Off));
        assert_eq!("on-start".parse(), Ok(SelftestSchedule::OnStart));
        assert_eq!("every 5 probes".parse(), Ok(SelftestSchedule::Every(5)));
        assert_eq!("every 1".parse(), Ok(SelftestSchedule::Every(1)));
        for bad in ["", "always", "every 0 probes", "every x probes", "on start"] {
            let e = bad.parse::<SelftestSchedule>().unwrap_err();
            assert!(e.contains("every N probes"), "{bad}: {e}");
        }
    }

    fn gid(index: u32, gid: &str, t: GidType) -> Gid {
        Gid {
            index,
            gid: gid.into(),
            gid_type: Some(t),
            netdev: Some("eth0".into()),
        }
    }

    /// The GID table rxe0 showed in the VM: link-local v2 at 0, IPv4-mapped v2 at 1.
    #[test]
    fn picks_the_ipv4_mapped_roce_v2_gid() {
        let port = PortReport {
            port: 1,
            gids: vec![
                gid(
                    0,
                    "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                    GidType::IbRoceV1,
                ),
                gid(
                    1,
                    "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                    GidType::RoceV2,
                ),
                gid(
                    2,
                    "0000:0000:0000:0000:0000:ffff:0a00:020f",
                    GidType::IbRoceV1,
                ),
                gid(
                    3,
                    "0000:0000:0000:0000:0000:ffff:0a00:020f",
                    GidType::RoceV2,
                ),
            ],
            ..PortReport::default()
        };
        assert_eq!(pick_gid(&port), Some(3));
        let v1_only = PortReport {
            gids: vec![gid(0, "fe80::1", GidType::IbRoceV1)],
            ..PortReport::default()
        };
        assert_eq!(pick_gid(&v1_only), Some(0));
        assert_eq!(pick_gid(&PortReport::default()), None);
    }

    #[test]
    fn reg_mr_enomem_names_memlock_and_the_fix() {
        let e = StepError::os("reg_mr", &io::Error::from_raw_os_error(libc::ENOMEM));
        assert_eq!(e.errno, Some(12));
        assert!(
            e.message
                .starts_with("reg_mr: errno 12 (ENOMEM): RLIMIT_MEMLOCK too low"),
            "{}",
            e.message
        );
        assert!(e.message.contains("IPC_LOCK"), "{}", e.message);
    }

    /// Without RDMA in the kernel the test must fail at a named step, not panic.
    #[test]
    fn selected_ports_without_rdma_fail_with_a_step() {
        let mut report = RdmaReport {
            devices: vec![DeviceReport {
                name: "fabricgate-test-no-such-dev".into(),
                ports: vec![PortReport {
                    port: 1,
                    ..PortReport::default()
                }],
                ..DeviceReport::default()
            }],
            ..RdmaReport::default()
        };
        run(&mut report, &mut |_, _| true, DEFAULT_TIMEOUT);
        let r = report.devices[0].ports[0].selftest.clone().unwrap();
        assert!(!r.ok);
        let step = r.failed_step.unwrap();
        assert!(step == "get_device_list" || step == "open_device", "{step}");
        assert!(r.message.unwrap().starts_with(&step));
    }
}
