//! `kubernetes.dra`: the DRA drivers that publish this node's HCAs (docs/dra.md). Empty
//! `drivers` (the default): the agent reads no ResourceSlice and writes no DeviceTaintRule.
//! The config keeps the section as written; DRA reads it with its own type
//! ([`FeatureSection::of`]), checked by every subcommand at load.

use crate::config::duration::{bounded_duration, parse_bounded_duration};
use crate::config::{Config, FeatureSection, Section};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `kubernetes.dra.slice_grace`: the kubelet deletes every slice of its node when it starts,
/// and kubeletplugin's ResourceSlice controller publishes a deleted slice again only after its
/// 30 s sync delay (measured on the real node: gone 27 s after a kubelet restart,
/// docs/testing.md "DRA on the real node"), so a margin above that.
pub const DEFAULT_SLICE_GRACE: Duration = Duration::from_secs(45);

/// Where the kubelet keeps the plugins' registration sockets, as mounted (read-only) into the
/// agent's container.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// DraNet's driver name and attributes (kubernetes-sigs/dranet, pkg/apis/attributes.go).
pub const DRANET: &str = "dra.net";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DraSettings {
    /// The drivers whose devices are this node's HCAs.
    pub drivers: Vec<DraDriver>,
    /// The kubelet's plugin registration directory in the agent's container: each driver's
    /// `<driver>-reg.sock` (or `<driver>-<pod uid>-reg.sock`) must be there and answer.
    pub registry_dir: String,
    /// How a node with some bad HCAs is marked: `node` (the Node taint only, as without
    /// DRA), `device` (a DeviceTaintRule per bad HCA; the Node taint only for node-wide
    /// failures) or `both` (a rule per bad HCA, and any bad HCA taints the Node too).
    pub taint_scope: TaintScope,
    /// The rules' effect: `NoSchedule`, or `NoExecute` (kube-controller-manager then evicts
    /// the pods that hold the device).
    pub taint_effect: DeviceTaintEffect,
    /// How long a driver whose slices all vanished (a kubelet restart) is held back from
    /// `DraDriverUnavailable` (humantime, 0s to 10m; `0s`: off). A plugin that is gone is
    /// caught at once by its registration socket either way.
    #[serde(with = "slice_grace")]
    pub slice_grace: Duration,
}

bounded_duration!(
    slice_grace,
    "kubernetes.dra.slice_grace",
    Duration::ZERO,
    Duration::from_secs(600)
);

impl Default for DraSettings {
    fn default() -> Self {
        Self {
            drivers: Vec::new(),
            registry_dir: DEFAULT_REGISTRY_DIR.into(),
            taint_scope: TaintScope::Device,
            taint_effect: DeviceTaintEffect::NoSchedule,
            slice_grace: DEFAULT_SLICE_GRACE,
        }
    }
}

/// One DRA driver and the attributes that name an HCA in its slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraDriver {
    /// The driver's name, as in `spec.driver` of its ResourceSlices (`dra.net`).
    pub name: String,
    /// The attribute whose string value is the RDMA device (`mlx5_0`). Default:
    /// `<name>/rdmaDevice` (DraNet's).
    #[serde(default)]
    pub rdma_device_attribute: Option<String>,
    /// The attribute whose string value is the PCI address (`0000:18:00.0`), used when a
    /// device has no RDMA-device attribute. Default: `<name>/pciAddress` (DraNet's).
    #[serde(default)]
    pub pci_address_attribute: Option<String>,
}

impl DraDriver {
    pub fn rdma_device_attribute(&self) -> String {
        self.rdma_device_attribute
            .clone()
            .unwrap_or_else(|| format!("{}/rdmaDevice", self.name))
    }

    pub fn pci_address_attribute(&self) -> String {
        self.pci_address_attribute
            .clone()
            .unwrap_or_else(|| format!("{}/pciAddress", self.name))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaintScope {
    Node,
    Device,
    Both,
}

impl TaintScope {
    /// Whether bad HCAs get DeviceTaintRules.
    pub fn device_rules(self) -> bool {
        matches!(self, Self::Device | Self::Both)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceTaintEffect {
    NoSchedule,
    NoExecute,
}

impl DeviceTaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
        }
    }
}

impl DraSettings {
    /// Whether any driver is configured (the DRA path is on).
    pub fn enabled(&self) -> bool {
        !self.drivers.is_empty()
    }

    /// The configured drivers' names.
    pub fn driver_names(&self) -> Vec<String> {
        self.drivers.iter().map(|d| d.name.clone()).collect()
    }
}

impl FeatureSection for DraSettings {
    const KEY: &'static str = "kubernetes.dra";

    fn section(config: &Config) -> &Section {
        &config.kubernetes.dra
    }

    /// [`Error::ConfigValue`] naming `kubernetes.dra.registry_dir` (not absolute) or
    /// `kubernetes.dra.drivers` (a name that is not a DNS subdomain, listed twice, or an
    /// attribute that is not a device attribute's name).
    fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::ConfigValue {
                key: key.to_owned(),
                message,
            })
        };
        if !self.registry_dir.starts_with('/') {
            return bad(
                "kubernetes.dra.registry_dir",
                format!(
                    "{:?} is not an absolute path; give the kubelet's plugins_registry \
                     directory as mounted in the agent's container",
                    self.registry_dir
                ),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.drivers {
            if !is_dns_subdomain(&d.name) {
                return bad(
                    "kubernetes.dra.drivers",
                    format!(
                        "{:?} is not a DRA driver name (a DNS subdomain such as \"dra.net\")",
                        d.name
                    ),
                );
            }
            if !seen.insert(d.name.as_str()) {
                return bad(
                    "kubernetes.dra.drivers",
                    format!("driver {:?} is listed twice", d.name),
                );
            }
            for attribute in [&d.rdma_device_attribute, &d.pci_address_attribute]
                .into_iter()
                .flatten()
            {
                let name = attribute.rsplit('/').next().unwrap_or_default();
                if name.is_empty() || attribute.split('/').count() > 2 {
                    return bad(
                        "kubernetes.dra.drivers",
                        format!(
                            "attribute {attribute:?} of driver {:?} is not a device attribute \
                             name (`domain/name` or `name`)",
                            d.name
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}

/// A DNS subdomain (RFC 1123), as Kubernetes checks driver names.
fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_and_attributes_are_checked() {
        let mut dra = DraSettings::default();
        assert!(dra.validate().is_ok());
        dra.drivers.push(DraDriver {
            name: "dra.net".into(),
            rdma_device_attribute: None,
            pci_address_attribute: None,
        });
        assert!(dra.validate().is_ok());
        assert_eq!(dra.drivers[0].rdma_device_attribute(), "dra.net/rdmaDevice");
        assert_eq!(dra.drivers[0].pci_address_attribute(), "dra.net/pciAddress");
        dra.drivers.push(dra.drivers[0].clone());
        assert!(dra.validate().unwrap_err().to_string().contains("twice"));
        dra.drivers.pop();
        dra.drivers[0].name = "Dra_Net".into();
        assert!(dra.validate().is_err());
        dra.drivers[0].name = "dra.net".into();
        dra.drivers[0].rdma_device_attribute = Some("a/b/c".into());
        assert!(dra.validate().is_err());
        dra.drivers[0].rdma_device_attribute = None;
        dra.registry_dir = "relative".into();
        assert!(dra.validate().is_err());
    }
}
