//! Pure parsers for GPUDirect enablement: `/proc/modules`, `/proc/driver/nvidia/version` and
//! `/proc/sys/kernel/osrelease`.

/// One line of `/proc/modules`: `nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)`
/// (name, size, reference count, users, state, address, taint flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleLine {
    pub name: String,
    /// `Live`, `Loading` or `Unloading`.
    pub state: String,
}

/// Every well-formed line of `/proc/modules`; malformed lines are skipped.
pub fn parse_proc_modules(text: &str) -> Vec<ModuleLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (name, state) = (fields.first()?, fields.get(4)?);
            fields.get(1)?.parse::<u64>().ok()?;
            Some(ModuleLine {
                name: (*name).to_owned(),
                state: (*state).to_owned(),
            })
        })
        .collect()
}

/// What `/proc/driver/nvidia/version` says about the kernel driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaDriver {
    /// `550.54.15`
    pub version: String,
    /// The open-source kernel modules ("Open Kernel Module"), which export DMA-BUF.
    pub open: bool,
}

impl NvidiaDriver {
    /// Major version (`550`).
    pub fn major(&self) -> Option<u32> {
        self.version.split('.').next()?.parse().ok()
    }
}

/// Parse the `NVRM version:` line: `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
/// 535.104.05  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Aug 22 ...` or the proprietary
/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024`.
pub fn parse_nvidia_version(text: &str) -> Option<NvidiaDriver> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    let version = line
        .split_whitespace()
        .find(|w| {
            w.contains('.')
                && w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })?
        .to_owned();
    Some(NvidiaDriver {
        version,
        open: line.contains("Open Kernel Module"),
    })
}

/// `(major, minor)` of a kernel release such as `5.15.0-105-generic` or `6.8.0`.
pub fn parse_kernel_release(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let minor = minor.parse().ok()?;
    Some((major, minor))
}

/// `ib_umem_dmabuf` (RDMA memory registration of a DMA-BUF) arrived in Linux 5.12.
pub const DMABUF_MIN_KERNEL: (u32, u32) = (5, 12);
/// The first NVIDIA driver whose open kernel modules export GPU memory as DMA-BUF for RDMA.
pub const DMABUF_MIN_DRIVER: u32 = 515;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_modules_lines() {
        let text = "nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)\n\
                    nvidia 56164352 437 nvidia_uvm,nvidia_peermem,nvidia_modeset, Live 0x0000000000000000 (POE)\n\
                    ib_core 507904 9 rdma_ucm,ib_ipoib,nvidia_peermem,mlx5_ib, Loading 0x0000000000000000\n\
                    garbage\n";
        let m = parse_proc_modules(text);
        assert_eq!(m.len(), 3);
        assert_eq!(
            m[0],
            ModuleLine {
                name: "nvidia_peermem".into(),
                state: "Live".into()
            }
        );
        assert_eq!(m[2].state, "Loading");
    }

    #[test]
    fn nvidia_driver_versions() {
        let prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n\
                    GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n";
        let d = parse_nvidia_version(prop).unwrap();
        assert_eq!(
            (d.version.as_str(), d.open, d.major()),
            ("550.54.15", false, Some(550))
        );
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Aug 22 20:07:00 UTC 2023\n";
        let d = parse_nvidia_version(open).unwrap();
        assert_eq!((d.version.as_str(), d.open), ("535.104.05", true));
        assert_eq!(parse_nvidia_version("GCC version: 12.3.0\n"), None);
    }

    #[test]
    fn kernel_releases() {
        assert_eq!(parse_kernel_release("5.15.0-105-generic\n"), Some((5, 15)));
        assert_eq!(parse_kernel_release("6.8.0"), Some((6, 8)));
        assert_eq!(
            parse_kernel_release("5.14.0-427.13.1.el9_4.x86_64"),
            Some((5, 14))
        );
        assert_eq!(parse_kernel_release("6.12rc1"), Some((6, 12)));
        assert_eq!(parse_kernel_release("linux"), None);
    }
}
