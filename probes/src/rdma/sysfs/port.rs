//! The open files of one port: state, rate, link layer and LIDs, its GID table, and its
//! counter groups with the values of their last read.

use super::CounterNames;
use super::attr::{get, quiet};
use super::parse::{
    CounterText, is_zero_gid, parse_counter, parse_hex_u32, parse_phys_state, parse_port_state,
    parse_rate,
};
use crate::error::ProbeError;
use crate::rdma::{Gid, GidType, LinkLayer, PortReport};
use crate::sysfs_io::{Attr, AttrBuf, DirStamp, list_dir};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub(super) struct PortHandles {
    pub(super) port: u32,
    dir: PathBuf,
    stamp: Option<DirStamp>,
    pub(super) state: Attr,
    pub(super) phys_state: Attr,
    rate: Attr,
    link_layer: Attr,
    lid: Attr,
    sm_lid: Attr,
    gids_dir: PathBuf,
    gids: Vec<GidHandles>,
    /// The GIDs in use as last read; an InfiniBand port's table is re-read on the slow
    /// cadence only (the verdict reads GIDs of Ethernet ports alone, and an mlx5 IB port
    /// lists 128 entries), any other port's on every probe.
    gids_read: Option<Vec<Gid>>,
    gids_error: Option<String>,
    counter_names: Arc<CounterNames>,
    counters: CounterGroup,
    hw_counters: CounterGroup,
    /// When the counter groups were last read (seconds since the Unix epoch).
    counters_timestamp: Option<f64>,
}

struct GidHandles {
    index: u32,
    gid: Attr,
    gid_type: Attr,
    netdev: Attr,
}

/// `counters/` or `hw_counters/`: its files and the values of their last read.
struct CounterGroup {
    files: Vec<(String, Attr)>,
    list_error: Option<String>,
    values: Arc<BTreeMap<String, u64>>,
    /// Problems of the last read, reported with its values until the next one.
    errors: Vec<String>,
}

impl PortHandles {
    pub(super) fn open(dir: PathBuf, port: u32, names: &Arc<CounterNames>) -> Self {
        let gids_dir = dir.join("gids");
        let mut p = Self {
            port,
            stamp: DirStamp::of(&dir),
            state: Attr::open(dir.join("state")),
            phys_state: Attr::open(dir.join("phys_state")),
            rate: Attr::open(dir.join("rate")),
            link_layer: Attr::open(dir.join("link_layer")),
            lid: Attr::open(dir.join("lid")),
            sm_lid: Attr::open(dir.join("sm_lid")),
            gids: Vec::new(),
            gids_read: None,
            gids_error: None,
            counters: CounterGroup::open(dir.join("counters"), names.counters.as_deref()),
            hw_counters: CounterGroup::open(dir.join("hw_counters"), names.hw_counters.as_deref()),
            counter_names: Arc::clone(names),
            counters_timestamp: None,
            gids_dir,
            dir,
        };
        p.open_gids();
        p
    }

    fn open_gids(&mut self) {
        self.gids.clear();
        self.gids_error = None;
        let listing = match list_dir(&self.gids_dir) {
            Ok(Some(listing)) => listing,
            Ok(None) => return,
            Err(e) => {
                self.gids_error = Some(e.to_string());
                return;
            }
        };
        let mut indices: Vec<u32> = listing
            .names
            .iter()
            .filter_map(|n| n.parse().ok())
            .collect();
        indices.sort_unstable();
        let attrs = self.dir.join("gid_attrs");
        self.gids = indices
            .into_iter()
            .map(|index| {
                let idx = index.to_string();
                GidHandles {
                    index,
                    gid: Attr::open(self.gids_dir.join(&idx)),
                    gid_type: Attr::open(attrs.join("types").join(&idx)),
                    netdev: Attr::open(attrs.join("ndevs").join(&idx)),
                }
            })
            .collect();
    }

    pub(super) fn read(
        &mut self,
        buf: &mut AttrBuf,
        slow: bool,
        now: f64,
        gone: &mut bool,
    ) -> PortReport {
        if DirStamp::of(&self.dir) != self.stamp {
            let names = Arc::clone(&self.counter_names);
            *self = Self::open(std::mem::take(&mut self.dir), self.port, &names);
        }
        let mut p = PortReport {
            port: self.port,
            ..PortReport::default()
        };
        let errors = &mut p.errors;
        p.state = get(
            &self.state,
            buf,
            "\"N: STATE\" such as \"4: ACTIVE\"",
            errors,
            gone,
            parse_port_state,
        );
        p.phys_state = get(
            &self.phys_state,
            buf,
            "\"N: STATE\" such as \"5: LinkUp\"",
            errors,
            gone,
            parse_phys_state,
        );
        p.rate = get(
            &self.rate,
            buf,
            "\"N Gb/sec (WX SPEED)\"",
            errors,
            gone,
            parse_rate,
        );
        p.link_layer = get(&self.link_layer, buf, "a link layer", errors, gone, |s| {
            Some(LinkLayer::parse(s))
        });
        p.lid = get(&self.lid, buf, "a hex LID", errors, gone, parse_hex_u32);
        p.sm_lid = get(&self.sm_lid, buf, "a hex LID", errors, gone, parse_hex_u32);
        if let Some(e) = &self.gids_error {
            errors.push(e.clone());
        }
        let gids = match &self.gids_read {
            Some(gids) if !slow && p.link_layer == Some(LinkLayer::InfiniBand) => gids.clone(),
            _ => {
                let gids: Vec<Gid> = self.gids.iter().filter_map(|g| g.read(buf)).collect();
                self.gids_read = Some(gids.clone());
                gids
            }
        };
        p.gids = gids;

        if slow || self.counters_timestamp.is_none() {
            self.counters.read(buf, gone);
            self.hw_counters.read(buf, gone);
            self.counters_timestamp = Some(now);
        }
        p.counters = Arc::clone(&self.counters.values);
        p.hw_counters = Arc::clone(&self.hw_counters.values);
        p.counters_timestamp = self.counters_timestamp;
        errors.extend(self.counters.errors.iter().cloned());
        errors.extend(self.hw_counters.errors.iter().cloned());
        p
    }
}

impl GidHandles {
    fn read(&self, buf: &mut AttrBuf) -> Option<Gid> {
        // Unused entries read as all zeroes (or fail on some kernels): not in use.
        let gid = match self.gid.read(buf) {
            Ok(Some(g)) if !is_zero_gid(g) => g.trim().to_owned(),
            _ => return None,
        };
        // The kernel answers EINVAL for attributes of entries without a netdev (InfiniBand).
        let gid_type = quiet(&self.gid_type, buf, |s| Some(GidType::parse(s)));
        let netdev = quiet(&self.netdev, buf, |s| {
            Some(s.trim().to_owned()).filter(|s| !s.is_empty())
        });
        Some(Gid {
            index: self.index,
            gid,
            gid_type,
            netdev,
        })
    }
}

impl CounterGroup {
    /// List `dir` and open its files (only those in `wanted`, when given): once per port open,
    /// since the kernel creates the group with its port.
    fn open(dir: PathBuf, wanted: Option<&[String]>) -> Self {
        let mut list_error = None;
        let files = match list_dir(&dir) {
            Ok(Some(listing)) => listing
                .names
                .into_iter()
                .filter(|name| wanted.is_none_or(|w| w.contains(name)))
                .map(|name| {
                    let attr = Attr::open(dir.join(&name));
                    (name, attr)
                })
                .collect(),
            Ok(None) => Vec::new(),
            Err(e) => {
                list_error = Some(e.to_string());
                Vec::new()
            }
        };
        Self {
            files,
            list_error,
            values: Arc::new(BTreeMap::new()),
            errors: Vec::new(),
        }
    }

    /// Re-read every counter, updating the values in place (no allocation once the names
    /// are known and the previous report has been dropped).
    fn read(&mut self, buf: &mut AttrBuf, gone: &mut bool) {
        self.errors.clear();
        if let Some(e) = &self.list_error {
            self.errors.push(e.clone());
        }
        let values = Arc::make_mut(&mut self.values);
        for (name, attr) in &self.files {
            let value = match attr.read(buf) {
                Ok(Some(text)) => match parse_counter(text) {
                    Some(CounterText::Value(v)) => Some(v),
                    Some(CounterText::NotAvailable) => None,
                    // `lifespan` is a writable knob in hw_counters, not a counter.
                    None if name == "lifespan" => None,
                    None => {
                        self.errors.push(
                            ProbeError::parse(attr.path(), text, "a decimal counter").to_string(),
                        );
                        None
                    }
                },
                Ok(None) => None,
                Err(e) => {
                    *gone |= e.is_gone();
                    self.errors.push(e.to_string());
                    None
                }
            };
            match (value, values.get_mut(name.as_str())) {
                (Some(v), Some(slot)) => *slot = v,
                (Some(v), None) => {
                    values.insert(name.clone(), v);
                }
                (None, Some(_)) => {
                    values.remove(name.as_str());
                }
                (None, None) => {}
            }
        }
    }
}
