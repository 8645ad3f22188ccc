//! Kubernetes label keys, values and prefixes, as the config names them.

use crate::error::{Error, Result};

/// A Kubernetes label key: optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters (alphanumerics, `-`, `_`, `.`; alphanumeric at both ends).
pub fn validate_label_key(key: &str) -> std::result::Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && validate_label_prefix(&format!("{p}/")).is_err()
    {
        return Err(format!("{key:?}: the prefix {p:?} is not a DNS subdomain"));
    }
    if !is_label_value(name) || name.is_empty() {
        return Err(format!(
            "{key:?}: the name must be 1-63 characters of [A-Za-z0-9-_.], alphanumeric at both ends"
        ));
    }
    Ok(())
}

/// A valid Kubernetes label value (empty allowed): at most 63 characters of `[A-Za-z0-9-_.]`,
/// beginning and ending with an alphanumeric.
pub fn is_label_value(v: &str) -> bool {
    let alnum = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && alnum(v.chars().next())
        && alnum(v.chars().last())
}

/// A label prefix is a DNS subdomain followed by `/` (Kubernetes label key prefix rules).
pub(super) fn validate_label_prefix(prefix: &str) -> Result<()> {
    let err = |message: String| {
        Err(Error::ConfigValue {
            key: "node.label_prefix".into(),
            message,
        })
    };
    let Some(domain) = prefix.strip_suffix('/') else {
        return err(format!(
            "{prefix:?} must end with '/' (e.g. \"fabricgate.io/\")"
        ));
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.is_empty() || domain.len() > 253 || !domain.split('.').all(label_ok) {
        return err(format!(
            "{prefix:?} is not a DNS subdomain followed by '/' (lowercase letters, digits, '-', '.')"
        ));
    }
    Ok(())
}
