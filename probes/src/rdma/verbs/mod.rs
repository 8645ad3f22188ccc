//! The verbs wrapper: the only `unsafe` in fabricgate. Small RAII types over libibverbs
//! (`Drop` frees the device list and closes contexts, and never panics), plus the probe that
//! opens every device and queries every port (including down ones, which the `ibverbs`
//! crate's `Device::open()` refuses).

pub mod events;
pub mod objects;
pub mod rc;
pub mod selftest;
mod transitions;

use super::{LinkLayer, PhysState, PortState, RdmaReport, VerbsDevice, VerbsPort, VerbsStatus};
use rdma_sys as sys;
use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::os::raw::c_int;

/// The list returned by `ibv_get_device_list`; freed on drop.
pub struct DeviceList {
    ptr: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    /// # Errors
    /// The errno of `ibv_get_device_list`: `ENOSYS` when the kernel has no RDMA support,
    /// `ENOMEM`, or whatever the provider discovery reports.
    pub fn new() -> io::Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array (when non-null) stays valid
        // until `ibv_free_device_list`, which only `Drop` calls.
        let ptr = unsafe { sys::ibv_get_device_list(&mut n) };
        if ptr.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> {
        (0..self.len).filter_map(move |i| {
            // SAFETY: `i < len`, and libibverbs guarantees `len` valid entries.
            let ptr = unsafe { *self.ptr.add(i) };
            (!ptr.is_null()).then_some(Device {
                ptr,
                _list: PhantomData,
            })
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `ibv_get_device_list` and is freed exactly once, here.
        unsafe { sys::ibv_free_device_list(self.ptr) };
    }
}

/// A device in a [`DeviceList`]; borrowed from it.
#[derive(Clone, Copy)]
pub struct Device<'list> {
    ptr: *mut sys::ibv_device,
    _list: PhantomData<&'list DeviceList>,
}

impl<'list> Device<'list> {
    /// Kernel device name (`mlx5_0`, `rxe0`).
    pub fn name(&self) -> String {
        // SAFETY: `ptr` is a live entry of the device list; `name` is a NUL-terminated array.
        let raw = unsafe { &(*self.ptr).name };
        c_array_to_string(raw)
    }

    /// The uverbs character device (`/dev/infiniband/uverbs0`) the context is opened through.
    pub fn dev_path(&self) -> String {
        // SAFETY: as above; `dev_name` is a NUL-terminated array.
        let raw = unsafe { &(*self.ptr).dev_name };
        format!("/dev/infiniband/{}", c_array_to_string(raw))
    }

    /// # Errors
    /// The errno of `ibv_open_device` (`EACCES`/`EPERM` without access to the uverbs device,
    /// `ENOENT`/`ENODEV` when `/dev/infiniband` is not there, `ENOSYS` without a provider).
    pub fn open(&self) -> io::Result<Context<'list>> {
        // SAFETY: `ptr` is a live device-list entry; a non-null result is owned by `Context`.
        let ctx = unsafe { sys::ibv_open_device(self.ptr) };
        if ctx.is_null() {
            let err = io::Error::last_os_error();
            // libibverbs does not always set errno on failure; never report "success".
            return Err(if err.raw_os_error() == Some(0) {
                io::Error::from_raw_os_error(libc::ENODEV)
            } else {
                err
            });
        }
        Ok(Context {
            ptr: ctx,
            _list: PhantomData,
        })
    }
}

/// An open device context; closed on drop.
pub struct Context<'list> {
    ptr: *mut sys::ibv_context,
    _list: PhantomData<&'list DeviceList>,
}

/// The parts of `ibv_device_attr` fabricgate reports.
#[derive(Debug, Clone)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub phys_port_cnt: u8,
    pub max_qp: i32,
    pub max_mr_size: u64,
}

impl Context<'_> {
    /// # Errors
    /// The errno returned by `ibv_query_device`.
    pub fn query_device(&self) -> io::Result<DeviceAttr> {
        // SAFETY: an all-zero `ibv_device_attr` is a valid value (plain integers and arrays).
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ptr` is an open context and `attr` a valid out-pointer.
        let rc = unsafe { sys::ibv_query_device(self.ptr, &mut attr) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(DeviceAttr {
            fw_ver: c_array_to_string(&attr.fw_ver),
            node_guid: u64::from_be(attr.node_guid),
            phys_port_cnt: attr.phys_port_cnt,
            max_qp: attr.max_qp,
            max_mr_size: attr.max_mr_size,
        })
    }

    /// `ibv_query_port` on any port, whatever its state.
    ///
    /// # Errors
    /// The errno returned by the provider (`EINVAL` for a port that does not exist).
    pub fn query_port(&self, port: u8) -> io::Result<VerbsPort> {
        // SAFETY: an all-zero `ibv_port_attr` is a valid value.
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ptr` is an open context and `attr` a valid out-pointer of the size the
        // inline helper passes to the provider.
        let rc = unsafe { sys::___ibv_query_port(self.ptr, port, &mut attr) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(port_from_attr(&attr))
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `ibv_open_device` and is closed exactly once, here. A
        // failure to close cannot be acted upon in `Drop` and is ignored.
        let _ = unsafe { sys::ibv_close_device(self.ptr) };
    }
}

fn c_array_to_string(raw: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    CStr::from_bytes_until_nul(&[bytes.as_slice(), &[0]].concat())
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn port_from_attr(attr: &sys::ibv_port_attr) -> VerbsPort {
    // verbs.h: IBV_LINK_LAYER_UNSPECIFIED (0, predates RoCE: InfiniBand), _INFINIBAND (1),
    // _ETHERNET (2).
    let link_layer = match attr.link_layer {
        2 => LinkLayer::Ethernet,
        0 | 1 => LinkLayer::InfiniBand,
        n => LinkLayer::Unknown(n.to_string()),
    };
    VerbsPort {
        state: PortState::from_code(u8::try_from(attr.state).unwrap_or(u8::MAX)),
        phys_state: PhysState::from_code(attr.phys_state),
        link_layer,
        rate_gbps: rate_gbps(attr.active_width, attr.active_speed),
        active_width: attr.active_width,
        active_speed: u32::from(attr.active_speed),
        lid: attr.lid,
        sm_lid: attr.sm_lid,
        active_mtu: mtu_bytes(attr.active_mtu),
        gid_tbl_len: attr.gid_tbl_len,
    }
}

/// Rate as the kernel's `rate_show` computes it: lanes × nominal lane speed.
pub fn rate_gbps(active_width: u8, active_speed: u8) -> Option<f64> {
    let lanes = match active_width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let lane = match active_speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => return None,
    };
    Some(lanes * lane)
}

fn mtu_bytes(mtu: sys::ibv_mtu::Type) -> u32 {
    match mtu {
        1..=5 => 128 << mtu,
        _ => 0,
    }
}

/// The verbs MTU enum for a byte count (the largest MTU that fits), for `modify_qp`.
pub(crate) fn mtu_enum(bytes: u32) -> sys::ibv_mtu::Type {
    match bytes {
        4096.. => sys::ibv_mtu::IBV_MTU_4096,
        2048.. => sys::ibv_mtu::IBV_MTU_2048,
        1024.. => sys::ibv_mtu::IBV_MTU_1024,
        512.. => sys::ibv_mtu::IBV_MTU_512,
        _ => sys::ibv_mtu::IBV_MTU_256,
    }
}

/// The name of a work-completion status (`IBV_WC_RETRY_EXC_ERR` as libibverbs words it).
pub(crate) fn wc_status_str(status: sys::ibv_wc_status::Type) -> String {
    // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, static, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// Advice for an errno from opening a device, naming the device file.
fn open_advice(dev_path: &str, err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => format!(
            "cannot open {dev_path}: permission denied; mount /dev/infiniband into the container \
             and allow access to it (device plugin or hostPath with a matching device cgroup rule)"
        ),
        Some(libc::ENOENT | libc::ENODEV | libc::ENXIO) => format!(
            "cannot open {dev_path}: no such device; mount /dev/infiniband into the container \
             (the device plugin did not expose it)"
        ),
        Some(libc::ENOSYS | libc::EOPNOTSUPP) => format!(
            "cannot open {dev_path}: {err}; install the libibverbs provider for this HCA \
             (ibverbs-providers) in the image"
        ),
        _ => format!("cannot open {dev_path}: {err}"),
    }
}

fn list_advice(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::ENOSYS) => format!(
            "ibv_get_device_list: {err}: this kernel has no RDMA support; load the RDMA core \
             and HCA driver modules (ib_core, ib_uverbs, mlx5_ib) on the host"
        ),
        _ => format!("ibv_get_device_list: {err}"),
    }
}

/// Open every device in verbs and cross-check with what sysfs reported in `report`.
pub fn probe_into(report: &mut RdmaReport) {
    let list = match DeviceList::new() {
        Ok(list) => list,
        Err(e) => {
            let message = list_advice(&e);
            for dev in &mut report.devices {
                dev.verbs = Some(VerbsDevice {
                    error: Some(message.clone()),
                    ..VerbsDevice::default()
                });
            }
            report.verbs = Some(VerbsStatus {
                devices: Vec::new(),
                error: Some(message),
            });
            return;
        }
    };
    let seen: Vec<Device<'_>> = list.iter().collect();
    let names: Vec<String> = seen.iter().map(Device::name).collect();
    for dev in &mut report.devices {
        let Some(idx) = names.iter().position(|n| *n == dev.name) else {
            dev.verbs = Some(VerbsDevice {
                error: Some(format!(
                    "sysfs lists {} but libibverbs does not see it; install the provider \
                     library for this HCA (ibverbs-providers) and mount /dev/infiniband and \
                     /sys/class/infiniband_verbs into the container",
                    dev.name
                )),
                ..VerbsDevice::default()
            });
            continue;
        };
        let device = seen[idx];
        let ctx = match device.open() {
            Ok(ctx) => ctx,
            Err(e) => {
                dev.verbs = Some(VerbsDevice {
                    error: Some(open_advice(&device.dev_path(), &e)),
                    ..VerbsDevice::default()
                });
                continue;
            }
        };
        let mut info = VerbsDevice::default();
        match ctx.query_device() {
            Ok(attr) => {
                info.opened = true;
                info.fw_ver = Some(attr.fw_ver);
                info.node_guid = Some(format_guid(attr.node_guid));
                info.phys_port_cnt = Some(attr.phys_port_cnt);
                info.max_qp = Some(attr.max_qp);
                info.max_mr_size = Some(attr.max_mr_size);
            }
            Err(e) => info.error = Some(format!("{}: ibv_query_device: {e}", dev.name)),
        }
        for port in &mut dev.ports {
            let Ok(num) = u8::try_from(port.port) else {
                continue;
            };
            match ctx.query_port(num) {
                Ok(vp) => port.verbs = Some(vp),
                Err(e) => port
                    .errors
                    .push(format!("{} port {num}: ibv_query_port: {e}", dev.name)),
            }
        }
        dev.verbs = Some(info);
    }
    report.verbs = Some(VerbsStatus {
        devices: names,
        error: None,
    });
}

/// `ec0d:9a03:0078:6a6a`, the form sysfs uses for `node_guid`.
pub fn format_guid(guid: u64) -> String {
    let b = guid.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_match_the_kernel_table() {
        assert_eq!(rate_gbps(2, 128), Some(400.0)); // 4X NDR
        assert_eq!(rate_gbps(16, 128), Some(200.0)); // 2X NDR
        assert_eq!(rate_gbps(1, 1), Some(2.5)); // 1X SDR (rxe)
        assert_eq!(rate_gbps(2, 64), Some(200.0)); // 4X HDR
        assert_eq!(rate_gbps(3, 1), None);
    }

    #[test]
    fn guids_print_like_sysfs() {
        assert_eq!(format_guid(0xec0d_9a03_0078_6a6a), "ec0d:9a03:0078:6a6a");
    }

    #[test]
    fn open_errors_say_what_to_do() {
        let msg = open_advice(
            "/dev/infiniband/uverbs0",
            &io::Error::from_raw_os_error(libc::EACCES),
        );
        assert!(msg.contains("/dev/infiniband/uverbs0"), "{msg}");
        assert!(msg.contains("mount /dev/infiniband"), "{msg}");
    }

    /// On a kernel without RDMA the list call fails with ENOSYS (or, with an RDMA kernel but
    /// no devices, returns an empty list); either way it must not panic.
    #[test]
    fn device_list_on_this_host_does_not_panic() {
        match DeviceList::new() {
            Ok(list) => {
                for dev in list.iter() {
                    assert!(!dev.name().is_empty());
                }
            }
            Err(e) => assert!(!list_advice(&e).is_empty()),
        }
    }
}
