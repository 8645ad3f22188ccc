//! The `storage:` section and its key `storage.lustre.require_lnet`: the LNet
//! networks a Lustre client's imports must use (beside the top-level `lustre:` section, which
//! says which mounts must be healthy).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// `storage:` in the config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct StorageSettings {
    pub lustre: LustreNetworkSettings,
}

/// `storage.lustre:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LustreNetworkSettings {
    /// LNet networks the imports in scope must be connected over (`[o2ib]`): an import whose
    /// `current_connection` is on another network (`10.2.1.4@tcp`) fell back, and an LNet
    /// interface of a listed network that is down (or missing) is a finding. An entry without
    /// a number (`o2ib`) names every network of that LND; `o2ib1` names one. Empty: no check.
    pub require_lnet: Vec<String>,
}

impl StorageSettings {
    /// # Errors
    /// [`Error::ConfigValue`] naming `storage.lustre.require_lnet[i]` for an entry that is not
    /// an LNet network name.
    pub fn validate(&self) -> Result<()> {
        for (i, net) in self.lustre.require_lnet.iter().enumerate() {
            if !is_lnet_network(net) {
                return Err(Error::ConfigValue {
                    key: format!("storage.lustre.require_lnet[{i}]"),
                    message: format!(
                        "{net:?} is not an LNet network; give the network part of a NID as \
                         `lnetctl net show` lists it (e.g. o2ib, o2ib1, tcp)"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// An LND name and an optional number: lowercase letters and digits, starting with a letter.
fn is_lnet_network(net: &str) -> bool {
    net.len() <= 32
        && net.starts_with(|c: char| c.is_ascii_lowercase())
        && net
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn require_lnet_parses_defaults_empty_and_rejects_non_networks() {
        assert!(Config::default().storage.lustre.require_lnet.is_empty());
        let c = Config::parse("storage:\n  lustre:\n    require_lnet: [o2ib, tcp1]\n").unwrap();
        assert_eq!(c.storage.lustre.require_lnet, ["o2ib", "tcp1"]);
        for (yaml, key) in [
            (
                "storage:\n  lustre:\n    require_lnet: [\"10.1.1.1@o2ib\"]\n",
                "storage.lustre.require_lnet[0]",
            ),
            (
                "storage:\n  lustre:\n    require_lnet: [o2ib, O2IB]\n",
                "storage.lustre.require_lnet[1]",
            ),
            (
                "storage:\n  lustre:\n    require_lnet: [\"\"]\n",
                "require_lnet[0]",
            ),
            (
                "storage:\n  lustre:\n    require_lent: [o2ib]\n",
                "require_lent",
            ),
            ("storage:\n  nfs: {}\n", "nfs"),
        ] {
            let e = Config::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
    }
}
