//! GPUDirect RDMA readiness from sysfs and procfs: which NVIDIA GPUs the node has, the PCIe
//! relation between each GPU and its nearest HCA (the rail map), the ACS control register of
//! every bridge on each GPU–HCA path, whether the peer-memory (or DMA-BUF) path is usable, and
//! the transport settings of the RDMA ports.
//!
//! Pure parsers live in [`pci`], [`modules`] and [`transport`]; this module does the reading,
//! every path through [`Roots`].

pub mod modules;
pub mod pci;
pub mod transport;

use crate::collect::{Collector, Fact, Pass};
use crate::rdma::RdmaReport;
use crate::report::ProbeReport;
use crate::roots::Roots;
use crate::sysfs_io::{AttrBuf, AttrReader, KeptAttr, list_dir};
use pci::{AcsState, PciPath, Relation};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use transport::{Ecn, MtuSource, PortTransport};

/// What the GPUDirect probe looks at.
#[derive(Debug, Clone, Default)]
pub struct GpudirectConfig {
    /// Glob over RDMA device names that count as HCAs (the requirements' `rdma.devices`);
    /// `None`: all.
    pub hca_devices: Option<String>,
}

impl GpudirectConfig {
    /// The compiled glob. Compiling it (a regex) cost more than the rest of the GPUDirect
    /// probe of a GPU-less node, on every probe; the last one is kept (agent CPU).
    fn matcher(&self) -> Option<globset::GlobMatcher> {
        type Compiled = (Option<String>, Option<globset::GlobMatcher>);
        static LAST: std::sync::Mutex<Option<Compiled>> = std::sync::Mutex::new(None);
        let mut last = LAST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((pattern, matcher)) = last.as_ref()
            && *pattern == self.hca_devices
        {
            return matcher.clone();
        }
        let matcher = globset::Glob::new(self.hca_devices.as_deref().unwrap_or("*"))
            .ok()
            .map(|g| g.compile_matcher());
        *last = Some((self.hca_devices.clone(), matcher.clone()));
        matcher
    }
}

/// One probe's GPUDirect facts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpudirectReport {
    /// NVIDIA GPUs (vendor 0x10de, display/3D class), in PCI address order.
    pub gpus: Vec<Gpu>,
    /// In-scope RDMA devices that sit on a PCI function, in name order.
    pub hcas: Vec<Hca>,
    /// Each GPU and its nearest HCA (at most `ceil(gpus / hcas)` GPUs share one HCA).
    pub pairs: Vec<Pair>,
    /// The worst relation over `pairs`.
    pub worst_relation: Option<Relation>,
    pub peermem: PeerMemory,
    pub transport: Vec<PortTransport>,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    /// `0000:18:00.0`
    pub address: String,
    /// PCI device ID (`0x2330`).
    pub device: Option<String>,
    /// PCI class (`0x030200`).
    pub class: String,
    pub numa_node: Option<u32>,
    /// Below the sysfs root: `devices/pci0000:10/.../0000:18:00.0`.
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hca {
    pub name: String,
    pub address: String,
    pub numa_node: Option<u32>,
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pair {
    /// The GPU's PCI address.
    pub gpu: String,
    /// The RDMA device name (`mlx5_0`).
    pub hca: String,
    pub hca_address: String,
    pub relation: Relation,
    /// The GPU's NUMA node.
    pub numa: Option<u32>,
    pub hca_numa: Option<u32>,
    /// Bridges and switch ports a peer-to-peer transfer crosses, GPU side first.
    pub bridges: Vec<Bridge>,
}

impl Pair {
    /// Bridges whose ACS control redirects peer-to-peer requests or completions.
    pub fn redirecting_bridges(&self) -> impl Iterator<Item = &Bridge> {
        self.bridges.iter().filter(|b| b.acs.redirects())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bridge {
    pub address: String,
    pub acs: AcsState,
}

/// How GPU memory can be registered with the HCA.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PeerMemory {
    /// `nvidia_peermem` or the legacy `nv_peer_mem`, when loaded.
    pub module: Option<String>,
    /// `Live`, `Loading`, `Unloading` (from `/proc/modules`; `Live` from `/sys/module`).
    pub module_state: Option<String>,
    /// Where the module was seen: `proc/modules` or `sys/module`.
    pub module_source: Option<String>,
    /// `/sys/kernel/mm/memory_peers/nv_mem*` exists (the MLNX_OFED peer-memory registry);
    /// `None` when that registry is absent (inbox kernels).
    pub registered: Option<bool>,
    /// NVIDIA kernel driver version from `/proc/driver/nvidia/version`.
    pub driver_version: Option<String>,
    /// The open-source kernel modules (they export GPU memory as DMA-BUF).
    pub open_kernel_modules: Option<bool>,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel_release: Option<String>,
    /// Open kernel modules >= 515 on Linux >= 5.12 (`ib_umem_dmabuf`).
    pub dmabuf: bool,
    /// `nvidia_peermem`, `nv_peer_mem`, `nv_mem` (a registered peer-memory client), `dma-buf`,
    /// or `None` when GPUDirect RDMA cannot work.
    pub method: Option<String>,
}

impl PeerMemory {
    pub fn usable(&self) -> bool {
        self.method.is_some()
    }
}

/// The collector's name, its key in the report and its `probe` label.
pub const NAME: &str = "gpudirect";

/// What this probe found, when the GPUDirect collector ran.
pub fn of(report: &ProbeReport) -> Option<&GpudirectReport> {
    report.facts.get(NAME)
}

/// The RDMA ports' transport settings this probe read (none when the collector did not run):
/// the RoCE MTU and ECN the RDMA policy also judges.
pub fn transport_of(report: &ProbeReport) -> &[PortTransport] {
    of(report).map_or(&[], |g| g.transport.as_slice())
}

/// Put `gpudirect` in `report` as the collector would have (a report built in code).
pub fn set(report: &mut ProbeReport, gpudirect: GpudirectReport) {
    report.facts.insert(NAME, fact(gpudirect).from_probe(NAME));
}

fn fact(report: GpudirectReport) -> Fact {
    let errors = report.errors.clone();
    Fact::new(report).with_errors(errors)
}

impl Collector for GpudirectReader {
    fn name(&self) -> &'static str {
        NAME
    }

    /// After the RDMA probe: the HCAs are placed where it resolved them.
    fn collect(&mut self, pass: &Pass<'_>) -> Fact {
        fact(self.probe(&pass.report.rdma, pass.slow))
    }
}

/// Read everything once; never fails as a whole (problems land in `errors`).
pub fn probe(roots: &Roots, config: &GpudirectConfig, rdma: &RdmaReport) -> GpudirectReport {
    GpudirectReader::new(roots, config.clone()).probe(rdma, true)
}

/// The GPUDirect probe, probe after probe: the sysfs root resolved once, the HCAs placed in
/// the PCIe tree where the RDMA probe resolved them, the GPUs found on the PCI bus kept
/// until the bus's function list changes (or the slow cadence comes), and the peer-memory
/// and transport files kept open. Resolving every HCA's links and re-opening ~10 files on
/// every probe was a tenth of the agent's CPU at `--interval 1s` on a GPU-less node.
pub struct GpudirectReader {
    roots: Roots,
    config: GpudirectConfig,
    sys_root: Option<PathBuf>,
    gpus: Option<GpuScan>,
    peer: PeerFiles,
    transport: transport::TransportFiles,
    /// The `config` of each bridge on a GPU–HCA path, by path.
    acs: BTreeMap<PathBuf, AcsFile>,
    reader: AttrReader,
}

/// The GPUs of one scan of `bus/pci/devices`.
struct GpuScan {
    /// The functions listed when scanned.
    functions: Vec<String>,
    gpus: Vec<(Gpu, PciPath)>,
    errors: Vec<String>,
}

impl GpudirectReader {
    pub fn new(roots: &Roots, config: GpudirectConfig) -> Self {
        Self {
            peer: PeerFiles::new(roots),
            roots: roots.clone(),
            config,
            sys_root: None,
            gpus: None,
            transport: transport::TransportFiles::default(),
            acs: BTreeMap::new(),
            reader: AttrReader::new(),
        }
    }

    /// `slow`: also scan the PCI bus for GPUs again though its function list is unchanged (a
    /// function re-created at the same address within one probe interval).
    pub fn probe(&mut self, rdma: &RdmaReport, slow: bool) -> GpudirectReport {
        let mut report = GpudirectReport::default();
        let matcher = self.config.matcher();
        let in_scope = |name: &str| matcher.as_ref().is_some_and(|m| m.is_match(name));
        if self.sys_root.is_none() {
            self.sys_root = self.roots.canonical_sysfs_root().ok();
        }
        let sys_root = self.sys_root.clone().unwrap_or_else(|| self.roots.sys(""));

        let gpus = self.scan_gpus(&sys_root, slow, &mut report.errors);
        let roots = &self.roots;
        let mut hcas = Vec::new();
        for dev in rdma.devices.iter().filter(|d| in_scope(&d.name)) {
            // Where the RDMA probe found the PCI function when it opened the device.
            let Some(pci) = &dev.pci else { continue };
            let Some(rel) = pci.sysfs_dir.as_deref() else {
                continue;
            };
            if let Some(path) = PciPath::parse(rel) {
                hcas.push((
                    Hca {
                        name: dev.name.clone(),
                        address: pci.address.clone(),
                        numa_node: pci.numa_node,
                        path: rel.to_owned(),
                    },
                    path,
                ));
            }
        }
        report.pairs = pair_up(&gpus, &hcas);
        let mut acs_cache: BTreeMap<String, AcsState> = BTreeMap::new();
        let mut acs_used = Vec::new();
        for pair in &mut report.pairs {
            let gpu_path = gpus
                .iter()
                .find(|(g, _)| g.address == pair.gpu)
                .map(|(_, p)| p);
            let hca_path = hcas
                .iter()
                .find(|(h, _)| h.name == pair.hca)
                .map(|(_, p)| p);
            for bridge in &mut pair.bridges {
                if let Some(acs) = acs_cache.get(&bridge.address) {
                    bridge.acs = *acs;
                    continue;
                }
                let dir = [gpu_path, hca_path]
                    .into_iter()
                    .flatten()
                    .find_map(|p| dir_of(p, &bridge.address));
                let acs = match dir {
                    Some(dir) => {
                        let path = roots.sys(dir).join("config");
                        let file = self
                            .acs
                            .entry(path.clone())
                            .or_insert_with(|| AcsFile::new(path.clone()));
                        acs_used.push(path);
                        file.read(&mut report.errors)
                    }
                    None => AcsState::Unknown { bytes_read: 0 },
                };
                acs_cache.insert(bridge.address.clone(), acs);
                bridge.acs = acs;
            }
        }
        self.acs.retain(|path, _| acs_used.contains(path));
        report.worst_relation = report.pairs.iter().map(|p| p.relation).max();
        report.gpus = gpus.into_iter().map(|(g, _)| g).collect();
        report.hcas = hcas.into_iter().map(|(h, _)| h).collect();
        report.peermem = self.peer.read(roots);
        report.transport = self.transport.probe(roots, rdma, &in_scope);
        report
    }

    /// The GPUs on the PCI bus: the last scan's while the bus lists the same functions and
    /// `slow` is false, else a new scan.
    fn scan_gpus(
        &mut self,
        sys_root: &Path,
        slow: bool,
        errors: &mut Vec<String>,
    ) -> Vec<(Gpu, PciPath)> {
        let dir = self.roots.sys("bus/pci/devices");
        let functions = match list_dir(&dir) {
            Ok(Some(listing)) => listing.names,
            Ok(None) => Vec::new(),
            Err(e) => {
                self.gpus = None;
                errors.push(e.to_string());
                return Vec::new();
            }
        };
        let unchanged = self
            .gpus
            .as_ref()
            .is_some_and(|scan| !slow && scan.functions == functions);
        if !unchanged {
            let mut scan_errors = Vec::new();
            let gpus = find_gpus(
                &dir,
                &functions,
                sys_root,
                &mut self.reader,
                &mut scan_errors,
            );
            self.gpus = Some(GpuScan {
                functions,
                gpus,
                errors: scan_errors,
            });
        }
        let Some(scan) = &self.gpus else {
            return Vec::new();
        };
        errors.extend(scan.errors.iter().cloned());
        scan.gpus.clone()
    }
}

/// `(path below the sysfs root, parsed)` of a device link, resolved like the kernel resolves
/// it; `None` unless it lands on a PCI function under `devices/pci*`.
fn resolve(sys_root: &Path, link: &Path) -> Option<(String, PciPath)> {
    let real = crate::sysfs_io::canonical_cached(link).ok()?;
    let rel = real.strip_prefix(sys_root).ok()?.to_str()?.to_owned();
    let parsed = PciPath::parse(&rel)?;
    Some((rel, parsed))
}

/// `devices/pci.../<address>` for a bridge on `path`.
fn dir_of(path: &PciPath, address: &str) -> Option<PathBuf> {
    let at = path.components.iter().position(|c| c == address)?;
    let mut dir = PathBuf::from("devices");
    dir.extend(&path.components[..=at]);
    Some(dir)
}

fn find_gpus(
    dir: &Path,
    functions: &[String],
    sys_root: &Path,
    reader: &mut AttrReader,
    errors: &mut Vec<String>,
) -> Vec<(Gpu, PciPath)> {
    let mut out = Vec::new();
    for name in functions.iter().filter(|n| pci::is_pci_address(n)) {
        let dev = dir.join(name);
        // Class first: most functions are not display controllers, one read rules them out.
        let Some(class) =
            reader.parsed(&dev.join("class"), "a hex class", errors, pci::parse_class)
        else {
            continue;
        };
        if (class >> 16) as u8 != pci::BASE_CLASS_DISPLAY {
            continue;
        }
        let Some(vendor) = reader.parsed(
            &dev.join("vendor"),
            "a hex vendor ID",
            errors,
            pci::parse_hex_u16,
        ) else {
            continue;
        };
        if !pci::is_nvidia_gpu(vendor, class) {
            continue;
        }
        let device = reader
            .read(&dev.join("device"))
            .ok()
            .flatten()
            .map(|s| s.trim().to_owned());
        let numa_node = reader
            .parsed(&dev.join("numa_node"), "an integer", errors, |s| {
                s.trim().parse::<i64>().ok()
            })
            .and_then(|n| u32::try_from(n).ok());
        let Some((rel, path)) = resolve(sys_root, &dev) else {
            errors.push(format!(
                "{}: does not resolve to a PCI function under devices/pci*",
                dev.display()
            ));
            continue;
        };
        out.push((
            Gpu {
                address: name.clone(),
                device,
                class: format!("0x{class:06x}"),
                numa_node,
                path: rel,
            },
            path,
        ));
    }
    out
}

/// Each GPU's nearest HCA: candidate pairs best relation first, each GPU taking one HCA, an
/// HCA serving at most `ceil(gpus / hcas)` GPUs (so 8 GPUs and 8 HCAs form 8 rails and a far
/// HCA shows up as such instead of two GPUs crowding a near one).
fn pair_up(gpus: &[(Gpu, PciPath)], hcas: &[(Hca, PciPath)]) -> Vec<Pair> {
    if hcas.is_empty() {
        return Vec::new();
    }
    let capacity = gpus.len().div_ceil(hcas.len()).max(1);
    let mut candidates = Vec::new();
    for (gi, (g, gp)) in gpus.iter().enumerate() {
        for (hi, (h, hp)) in hcas.iter().enumerate() {
            let (rel, bridges) = pci::relation(gp, g.numa_node, hp, h.numa_node);
            candidates.push((rel, bridges.len(), gi, hi, bridges));
        }
    }
    candidates.sort_by_key(|a| (a.0, a.1, a.2, a.3));
    let mut chosen: Vec<Option<Pair>> = vec![None; gpus.len()];
    let mut load = vec![0usize; hcas.len()];
    for (rel, _, gi, hi, bridges) in candidates {
        if chosen[gi].is_some() || load[hi] >= capacity {
            continue;
        }
        load[hi] += 1;
        let (g, h) = (&gpus[gi].0, &hcas[hi].0);
        chosen[gi] = Some(Pair {
            gpu: g.address.clone(),
            hca: h.name.clone(),
            hca_address: h.address.clone(),
            relation: rel,
            numa: g.numa_node,
            hca_numa: h.numa_node,
            bridges: bridges
                .into_iter()
                .map(|address| Bridge {
                    address,
                    acs: AcsState::Unknown { bytes_read: 0 },
                })
                .collect(),
        });
    }
    chosen.into_iter().flatten().collect()
}

/// A bridge's `config` kept open, with where its ACS capability sits. The list of extended
/// capabilities is fixed for the function's life, so once a full read found ACS a probe reads
/// the 8 bytes of its header and registers: a full read is up to 4 KiB of config space, as root
/// 1,024 configuration cycles on the bus per bridge, for a dozen bridges on a GPU node's
/// rails. An unprivileged read returns only 64 bytes and is done in full each time.
struct AcsFile {
    path: PathBuf,
    file: Option<File>,
    /// Offset of the ACS capability the last full read found.
    at: Option<usize>,
}

impl AcsFile {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            file: None,
            at: None,
        }
    }

    fn read(&mut self, errors: &mut Vec<String>) -> AcsState {
        let unknown = AcsState::Unknown { bytes_read: 0 };
        if self.file.is_none() {
            match crate::sysfs_io::open_regular(&self.path) {
                Ok(Some(file)) => self.file = Some(file),
                Ok(None) => {
                    let e = io::Error::from_raw_os_error(libc::ENOENT);
                    errors.push(format!("cannot read {}: {e}", self.path.display()));
                    return unknown;
                }
                Err(e) => {
                    errors.push(e.to_string());
                    return unknown;
                }
            }
        }
        let Some(file) = &self.file else {
            return unknown;
        };
        if let Some(at) = self.at {
            let mut regs = [0u8; 8];
            if let Ok(8) = file.read_at(&mut regs, at as u64)
                && let Some(acs) = pci::acs_at(&regs, 0)
            {
                return acs;
            }
        }
        let size = pci::EXT_CFG_SPACE_SIZE;
        match crate::sysfs_io::read_prefix(file, size, size) {
            Ok(config) => {
                self.at = pci::find_ext_capability(&config, pci::EXT_CAP_ID_ACS)
                    .ok()
                    .flatten();
                pci::parse_acs(&config)
            }
            Err(e) => {
                errors.push(format!("cannot read {}: {e}", self.path.display()));
                // Opened again next probe (the function may have been re-created).
                self.file = None;
                self.at = None;
                unknown
            }
        }
    }
}

/// The files that say how GPUDirect RDMA is enabled, kept open between probes.
struct PeerFiles {
    modules: KeptAttr,
    initstate: [(&'static str, KeptAttr); 2],
    nvidia_version: KeptAttr,
    osrelease: KeptAttr,
    buf: AttrBuf,
}

/// The peer-memory modules, preferred first.
const PEER_MODULES: [&str; 2] = ["nvidia_peermem", "nv_peer_mem"];

impl PeerFiles {
    fn new(roots: &Roots) -> Self {
        let initstate = |m: &str| KeptAttr::open(roots.sys("module").join(m).join("initstate"));
        Self {
            modules: KeptAttr::open(roots.proc("modules")),
            initstate: PEER_MODULES.map(|m| (m, initstate(m))),
            nvidia_version: KeptAttr::open(roots.proc("driver/nvidia/version")),
            osrelease: KeptAttr::open(roots.proc("sys/kernel/osrelease")),
            buf: AttrBuf::new(),
        }
    }

    /// How GPUDirect RDMA is enabled, from (in order): `/proc/modules` (else `/sys/module/<m>/
    /// initstate`) for `nvidia_peermem` / `nv_peer_mem`; `/sys/kernel/mm/memory_peers/nv_mem*`;
    /// `/proc/driver/nvidia/version` and `/proc/sys/kernel/osrelease` for DMA-BUF.
    fn read(&mut self, roots: &Roots) -> PeerMemory {
        let mut pm = PeerMemory::default();
        let mut ignored = Vec::new();
        let buf = &mut self.buf;
        match self.modules.read(buf) {
            Ok(Some(text)) => {
                let lines = modules::parse_proc_modules(text);
                if let Some(m) = PEER_MODULES
                    .iter()
                    .find_map(|want| lines.iter().find(|l| l.name == *want))
                {
                    pm.module = Some(m.name.clone());
                    pm.module_state = Some(m.state.clone());
                    pm.module_source = Some("proc/modules".into());
                }
            }
            _ => {
                for (m, initstate) in &mut self.initstate {
                    if let Some(state) = initstate.string(buf, &mut ignored) {
                        pm.module = Some((*m).to_owned());
                        pm.module_state = Some(if state == "live" {
                            "Live".to_owned()
                        } else {
                            state
                        });
                        pm.module_source = Some("sys/module".into());
                        break;
                    }
                }
            }
        }
        if let Ok(Some(peers)) = list_dir(&roots.sys("kernel/mm/memory_peers")) {
            pm.registered = Some(peers.names.iter().any(|p| p.starts_with("nv_mem")));
        }
        if let Ok(Some(text)) = self.nvidia_version.read(buf)
            && let Some(d) = modules::parse_nvidia_version(text)
        {
            pm.open_kernel_modules = Some(d.open);
            pm.dmabuf = d.open && d.major().is_some_and(|m| m >= modules::DMABUF_MIN_DRIVER);
            pm.driver_version = Some(d.version);
        }
        pm.kernel_release = self.osrelease.string(buf, &mut ignored);
        peer_method(pm)
    }
}

/// Which path GPU memory registration takes, from what [`PeerFiles::read`] found.
fn peer_method(mut pm: PeerMemory) -> PeerMemory {
    let kernel_ok = pm
        .kernel_release
        .as_deref()
        .and_then(modules::parse_kernel_release)
        .is_some_and(|k| k >= modules::DMABUF_MIN_KERNEL);
    pm.dmabuf &= kernel_ok;
    let live = pm.module_state.as_deref() == Some("Live");
    pm.method = if live {
        pm.module.clone()
    } else if pm.registered == Some(true) {
        Some("nv_mem".into())
    } else if pm.dmabuf {
        Some("dma-buf".into())
    } else {
        None
    };
    pm
}
