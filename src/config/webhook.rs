//! The `webhook:` section: what `fabricgate webhook` lets an opted-in pod say to NCCL
//! (docs/preflight.md, "What the webhook refuses").

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// NCCL's built-in verbs transport: the default (and first) entry of `webhook.nccl_net`.
pub const DEFAULT_NCCL_NET: &str = "IB";

/// `webhook:` in the config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookSettings {
    /// The verbs transports an RDMA container may name in `NCCL_NET` (NCCL compares
    /// case-insensitively). The first is the one the webhook sets where the pod sets none;
    /// add the names of verbs-based net plugins (e.g. `IBext` of nccl-rdma-sharp-plugins).
    pub nccl_net: Vec<String>,
    /// Admit pods that set `NCCL_IB_HCA` themselves (it overrides the port list preflight
    /// validated). Off: such pods are refused.
    pub allow_user_ib_hca: bool,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        Self {
            nccl_net: vec![DEFAULT_NCCL_NET.to_owned()],
            allow_user_ib_hca: false,
        }
    }
}

impl WebhookSettings {
    /// The transport the webhook sets in `NCCL_NET`.
    pub fn default_nccl_net(&self) -> &str {
        self.nccl_net
            .first()
            .map_or(DEFAULT_NCCL_NET, String::as_str)
    }

    /// Whether `value` (of `NCCL_NET`) names an allowed verbs transport, as NCCL compares
    /// (`strcasecmp`, no trimming).
    pub fn allows_nccl_net(&self, value: &str) -> bool {
        self.nccl_net.iter().any(|n| n.eq_ignore_ascii_case(value))
    }

    pub(super) fn validate(&self) -> Result<()> {
        let bad = |message: String| {
            Err(Error::ConfigValue {
                key: "webhook.nccl_net".into(),
                message,
            })
        };
        if self.nccl_net.is_empty() {
            return bad(format!(
                "is empty; list at least one verbs transport (default [{DEFAULT_NCCL_NET}])"
            ));
        }
        for name in &self.nccl_net {
            let plain = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !plain {
                return bad(format!(
                    "{name:?} is not a net name; give NCCL transport names such as IB or IBext"
                ));
            }
            if name.eq_ignore_ascii_case("Socket") {
                return bad(
                    "Socket is NCCL's TCP transport, not a verbs one; remove it (pods that \
                     need TCP sockets opt out with the label <prefix>preflight: \"false\")"
                        .into(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let d = WebhookSettings::default();
        assert_eq!(d.default_nccl_net(), "IB");
        assert!(d.allows_nccl_net("ib") && !d.allows_nccl_net(" IB"));
        assert!(!d.allows_nccl_net("Socket"));
        d.validate().unwrap();
        for bad in [
            vec![],
            vec!["socket".to_owned()],
            vec!["IB,Socket".to_owned()],
        ] {
            let s = WebhookSettings {
                nccl_net: bad.clone(),
                ..WebhookSettings::default()
            };
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains("webhook.nccl_net"), "{bad:?}: {e}");
        }
        let plugins: WebhookSettings =
            serde_norway::from_str("nccl_net: [IBext, IB]\nallow_user_ib_hca: true\n").unwrap();
        plugins.validate().unwrap();
        assert_eq!(plugins.default_nccl_net(), "IBext");
        assert!(plugins.allow_user_ib_hca);
    }
}
