//! The pool's one definition: the key `pool-selector` of the requirements ConfigMap, which the
//! kubelet mounts beside `requirements.yaml`. The guard's admission policy reads that same key
//! as its parameter (deploy/guard.yaml, `fabricgate-guard-pool`), so the agents, the guard, the
//! admission check and the policy cannot disagree on the pool.

use super::Config;
use super::file::read_config_file;
use super::labels::{is_label_value, validate_label_key};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The file beside the requirements file that holds the pool: `key=value[,key=value...]`.
pub const POOL_SELECTOR_FILE: &str = "pool-selector";

/// Where the pool of the requirements file at `config_path` is read from.
pub fn pool_selector_path(config_path: &Path) -> PathBuf {
    config_path
        .parent()
        .unwrap_or_else(|| Path::new(""))
        .join(POOL_SELECTOR_FILE)
}

/// Sets `node.pool_selector` from [`POOL_SELECTOR_FILE`] beside `config_path` when that file
/// exists. A requirements file that still sets `node.pool_selector` keeps working, without the
/// file or with the same pool in it.
///
/// # Errors
/// [`Error::ConfigRead`] if the file exists but cannot be read; [`Error::ConfigValue`] when it
/// is empty or not `key=value` labels joined by commas (the only form the guard's admission
/// policy reads), or when `node.pool_selector` names another pool.
pub(super) fn apply_pool_file(config: &mut Config, config_path: &Path) -> Result<()> {
    let path = pool_selector_path(config_path);
    let text = match read_config_file(&path) {
        Ok(text) => text,
        Err(Error::ConfigRead { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let pool = parse_pool(&text).map_err(|why| Error::ConfigValue {
        key: POOL_SELECTOR_FILE.to_owned(),
        message: format!(
            "{}: {why}; give the pool as key=value labels joined by commas (e.g. \
             \"nvidia.com/gpu.present=true\"), the DaemonSet's nodeSelector",
            path.display()
        ),
    })?;
    let set = &config.node.pool_selector;
    if !set.is_empty() && parse_pool(set).ok().as_ref() != Some(&pool) {
        return Err(Error::ConfigValue {
            key: "node.pool_selector".to_owned(),
            message: format!(
                "{set:?} is not the pool {:?} of {}; remove node.pool_selector from the \
                 requirements (the ConfigMap's key {POOL_SELECTOR_FILE} defines the pool, for \
                 the guard's admission policy too)",
                pool.join(","),
                path.display()
            ),
        });
    }
    config.node.pool_selector = pool.join(",");
    Ok(())
}

/// The terms of a pool, `key=value` each, trimmed, in their order.
fn parse_pool(text: &str) -> std::result::Result<Vec<String>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("it is empty".to_owned());
    }
    text.split(',')
        .map(|term| {
            let term = term.trim();
            let Some((key, value)) = term.split_once('=') else {
                return Err(format!("{term:?} is not key=value"));
            };
            validate_label_key(key).map_err(|e| format!("{term:?}: the key {e}"))?;
            if value.contains('=') || !is_label_value(value) {
                return Err(format!("{term:?}: {value:?} is not a label value"));
            }
            Ok(term.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(requirements: &str, pool: Option<&str>) -> Result<Config> {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("requirements.yaml");
        std::fs::write(&config, requirements).unwrap();
        if let Some(pool) = pool {
            std::fs::write(dir.path().join(POOL_SELECTOR_FILE), pool).unwrap();
        }
        Config::load(&config)
    }

    #[test]
    fn the_pool_file_beside_the_requirements_sets_node_pool_selector() {
        let c = load("", Some("nvidia.com/gpu.present=true\n")).unwrap();
        assert_eq!(c.node.pool_selector, "nvidia.com/gpu.present=true");
        let c = load("", Some(" pool=a , fabric=ib")).unwrap();
        assert_eq!(c.node.pool_selector, "pool=a,fabric=ib");
    }

    #[test]
    fn node_pool_selector_alone_or_the_same_pool_still_works() {
        let old = "node:\n  pool_selector: \"pool=a, fabric=ib\"\n";
        assert_eq!(
            load(old, None).unwrap().node.pool_selector,
            "pool=a, fabric=ib"
        );
        let c = load(old, Some("pool=a,fabric=ib")).unwrap();
        assert_eq!(c.node.pool_selector, "pool=a,fabric=ib");
    }

    #[test]
    fn a_pool_that_differs_from_node_pool_selector_is_an_error_naming_both() {
        let e = load("node:\n  pool_selector: \"pool=a\"\n", Some("pool=b"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node.pool_selector") && e.contains("pool=a") && e.contains("pool=b"),
            "{e}"
        );
        assert_eq!(
            load("node:\n  pool_selector: \"pool in (a)\"\n", Some("pool=a"))
                .unwrap_err()
                .exit_code(),
            crate::error::EXIT_USAGE
        );
    }

    #[test]
    fn an_empty_or_garbled_pool_is_an_error_naming_the_file() {
        for (pool, says) in [
            ("", "it is empty"),
            ("  \n", "it is empty"),
            ("nvidia.com/gpu.present", "is not key=value"),
            ("a=b,", "is not key=value"),
            ("a==b", "is not a label value"),
            ("a!=b", "the key"),
            ("pool in (a,b)", "is not key=value"),
            ("a=b c", "is not a label value"),
        ] {
            let e = load("", Some(pool)).unwrap_err();
            assert_eq!(e.exit_code(), crate::error::EXIT_USAGE, "{pool:?}");
            let e = e.to_string();
            assert!(
                e.contains(POOL_SELECTOR_FILE) && e.contains(says) && e.contains("key=value"),
                "{pool:?}: {e}"
            );
        }
    }
}
