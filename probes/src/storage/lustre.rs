//! Lustre client health, from the files the client modules export.
//!
//! - `<sysfs>/fs/lustre/health_check` (Lustre 2.10 and later; older clients have
//!   `<procfs>/fs/lustre/health_check`): `healthy`, `NOT HEALTHY` or `LBUG`.
//! - `<procfs>/fs/lustre/{mdc,osc}/<device>/import` (where newer clients moved it:
//!   `<sysfs>/kernel/debug/lustre/{mdc,osc}/<device>/import`): a YAML-like dump whose
//!   `    state: FULL` line is the connection state to that MDT or OST.
//! - `<sysfs>/fs/lustre/{mdc,osc}/<device>/active`: `0` when an administrator deactivated it.
//!
//! Nothing here touches a Lustre mount itself, so none of it can hang on a dead server.

use crate::roots::Roots;
use serde::Serialize;
use std::io;
use std::path::{Path, PathBuf};

/// Import states in which the client talks to the target normally.
const HEALTHY_STATES: [&str; 2] = ["FULL", "IDLE"];

/// What `health_check` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LustreHealth {
    Healthy,
    NotHealthy,
    /// The client hit an LBUG (a kernel assertion); only a reboot clears it.
    Lbug,
    /// Text we do not recognise (kept in `health_text`).
    Unknown,
}

/// The node's Lustre client as a whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LustreClient {
    /// The Lustre modules are loaded (`fs/lustre` exists in sysfs or procfs).
    pub present: bool,
    pub version: Option<String>,
    /// `None` when there is no client or `health_check` could not be read.
    pub health: Option<LustreHealth>,
    /// The `health_check` text when it is not plain `healthy` (names the unhealthy device on
    /// older clients).
    pub health_text: Option<String>,
    /// Every MDC and OSC device, sorted by device name.
    pub imports: Vec<Import>,
    /// The node's LNet interfaces (`lnet/nis`); `None` when LNet's file is not readable.
    pub lnet_nis: Option<Vec<crate::storage::LnetNi>>,
    /// Files that exist but could not be read.
    pub errors: Vec<String>,
}

/// One client-side connection to an MDT (`mdc`) or OST (`osc`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Import {
    /// `scratch-OST0003-osc-ffff8f7c4a9e1000`
    pub device: String,
    /// `mdc` or `osc`
    pub kind: String,
    /// `scratch-OST0003`
    pub target: String,
    /// `scratch`
    pub fsname: Option<String>,
    /// `FULL`, `IDLE`, `DISCONN`, ...; `None` when the import file was unreadable.
    pub state: Option<String>,
    pub healthy: bool,
    /// `current_connection:` (the server NID in use or last tried).
    pub connection: Option<String>,
    /// `Some(false)` when an administrator deactivated the device (`active` is 0).
    pub active: Option<bool>,
    /// Why the import file could not be read.
    pub error: Option<String>,
}

/// Read the client's health. Absent files mean "no client", not an error.
pub fn probe(roots: &Roots) -> LustreClient {
    let sys = roots.sys("fs/lustre");
    let proc = roots.proc("fs/lustre");
    let mut client = LustreClient {
        present: sys.is_dir() || proc.is_dir(),
        ..LustreClient::default()
    };
    if !client.present {
        return client;
    }

    if let Some(text) = read_first(
        &[sys.join("health_check"), proc.join("health_check")],
        &mut client.errors,
    ) {
        let health = parse_health(&text);
        if health != LustreHealth::Healthy {
            client.health_text = Some(text.trim_end().to_owned());
        }
        client.health = Some(health);
    }
    client.version = read_first(
        &[sys.join("version"), proc.join("version")],
        &mut client.errors,
    )
    .as_deref()
    .and_then(parse_version);

    for kind in ["mdc", "osc"] {
        let dirs = [
            roots.proc(format!("fs/lustre/{kind}")),
            roots.sys(format!("kernel/debug/lustre/{kind}")),
        ];
        let Some(dir) = dirs.iter().find(|d| d.is_dir()) else {
            continue;
        };
        let mut names: Vec<String> = match std::fs::read_dir(dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter(|e| e.path().join("import").exists())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect(),
            Err(e) => {
                client
                    .errors
                    .push(format!("cannot list {}: {e}", dir.display()));
                continue;
            }
        };
        names.sort();
        for name in names {
            client.imports.push(read_import(roots, dir, kind, name));
        }
    }
    client.imports.sort_by(|a, b| a.device.cmp(&b.device));
    client.lnet_nis = super::lnet::probe(roots);
    client
}

fn read_import(roots: &Roots, dir: &Path, kind: &str, device: String) -> Import {
    let path = dir.join(&device).join("import");
    let (fields, error) = match crate::sysfs_io::read_to_string(&path) {
        Ok(text) => (parse_import(&text), None),
        Err(e) => (
            ImportFields::default(),
            Some(format!("cannot read {}: {e}", path.display())),
        ),
    };
    let target = fields
        .target
        .as_deref()
        .map(|t| t.strip_suffix("_UUID").unwrap_or(t).to_owned())
        .unwrap_or_else(|| target_from_device(&device, kind));
    let fsname = target.rsplit_once('-').map(|(fs, _)| fs.to_owned());
    let active =
        crate::sysfs_io::read_to_string(&roots.sys(format!("fs/lustre/{kind}/{device}/active")))
            .ok()
            .and_then(|s| match s.trim() {
                "1" => Some(true),
                "0" => Some(false),
                _ => None,
            });
    let healthy = fields
        .state
        .as_deref()
        .is_some_and(|s| HEALTHY_STATES.contains(&s));
    Import {
        device,
        kind: kind.to_owned(),
        target,
        fsname,
        state: fields.state,
        healthy,
        connection: fields.current_connection,
        active,
        error,
    }
}

/// `scratch-OST0003-osc-ffff8f7c4a9e1000` → `scratch-OST0003`.
fn target_from_device(device: &str, kind: &str) -> String {
    device
        .rsplit_once(&format!("-{kind}-"))
        .map_or(device, |(t, _)| t)
        .to_owned()
}

/// First readable file of `paths`; a missing file is skipped silently, others are recorded.
fn read_first(paths: &[PathBuf], errors: &mut Vec<String>) -> Option<String> {
    for path in paths {
        match crate::sysfs_io::read_to_string(path) {
            Ok(text) => return Some(text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => errors.push(format!("cannot read {}: {e}", path.display())),
        }
    }
    None
}

/// `health_check` text → health. LBUG wins over NOT HEALTHY, which wins over healthy, because
/// older clients print one line per sick device before the verdict.
pub fn parse_health(text: &str) -> LustreHealth {
    if text.lines().any(|l| l.trim() == "LBUG") {
        LustreHealth::Lbug
    } else if text.contains("NOT HEALTHY") {
        LustreHealth::NotHealthy
    } else if text.trim() == "healthy" {
        LustreHealth::Healthy
    } else {
        LustreHealth::Unknown
    }
}

/// `2.15.3` (sysfs) or `lustre: 2.12.9` (old procfs, first line).
pub fn parse_version(text: &str) -> Option<String> {
    let line = text.lines().next()?.trim();
    let v = line.strip_prefix("lustre:").unwrap_or(line).trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// The fields of an `import` file that matter here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportFields {
    pub name: Option<String>,
    pub target: Option<String>,
    pub state: Option<String>,
    pub current_connection: Option<String>,
}

/// Parse the `import` file: `key: value` lines under `import:`; the first of each key wins.
pub fn parse_import(text: &str) -> ImportFields {
    let mut f = ImportFields::default();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once(':') else {
            continue;
        };
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        let slot = match key {
            "name" => &mut f.name,
            "target" => &mut f.target,
            "state" => &mut f.state,
            "current_connection" => &mut f.current_connection,
            _ => continue,
        };
        if slot.is_none() {
            *slot = Some(value.to_owned());
        }
    }
    f
}

/// `10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch/sub` → `scratch`.
pub fn fsname_from_source(source: &str) -> Option<String> {
    let (_, path) = source.rsplit_once(":/")?;
    let name = path.split('/').next()?;
    (!name.is_empty()).then(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_texts() {
        assert_eq!(parse_health("healthy\n"), LustreHealth::Healthy);
        assert_eq!(parse_health("NOT HEALTHY\n"), LustreHealth::NotHealthy);
        assert_eq!(
            parse_health("device scratch-OST0003-osc-ffff reported unhealthy\nNOT HEALTHY\n"),
            LustreHealth::NotHealthy
        );
        assert_eq!(parse_health("LBUG\nNOT HEALTHY\n"), LustreHealth::Lbug);
        assert_eq!(parse_health("LBUG\n"), LustreHealth::Lbug);
        assert_eq!(parse_health("\n"), LustreHealth::Unknown);
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("2.15.3\n").as_deref(), Some("2.15.3"));
        assert_eq!(
            parse_version("lustre: 2.12.9\nkernel: patchless_client\n").as_deref(),
            Some("2.12.9")
        );
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn import_fields() {
        let f = parse_import(
            "import:\n    name: scratch-OST0003-osc-ffff8f7c4a9e1000\n    target: scratch-OST0003_UUID\n    \
             state: DISCONN\n    connect_flags: [ write_grant, server_lock ]\n    connection:\n       \
             failover_nids: [ 10.1.1.3@o2ib ]\n       current_connection: 10.1.1.3@o2ib\n",
        );
        assert_eq!(
            f.name.as_deref(),
            Some("scratch-OST0003-osc-ffff8f7c4a9e1000")
        );
        assert_eq!(f.target.as_deref(), Some("scratch-OST0003_UUID"));
        assert_eq!(f.state.as_deref(), Some("DISCONN"));
        assert_eq!(f.current_connection.as_deref(), Some("10.1.1.3@o2ib"));
        assert_eq!(parse_import(""), ImportFields::default());
    }

    #[test]
    fn names() {
        assert_eq!(
            target_from_device("scratch-OST0003-osc-ffff8f7c4a9e1000", "osc"),
            "scratch-OST0003"
        );
        assert_eq!(target_from_device("odd", "osc"), "odd");
        assert_eq!(
            fsname_from_source("10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch").as_deref(),
            Some("scratch")
        );
        assert_eq!(
            fsname_from_source("10.1.1.1@tcp:/proj/sub/dir").as_deref(),
            Some("proj")
        );
        assert_eq!(fsname_from_source("/dev/sda1"), None);
    }
}
