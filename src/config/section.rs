//! A section of the requirements file that a feature above this floor owns (`runtime:`,
//! runtime transport's). The file's parse keeps it as written; the feature reads and checks it
//! ([`FeatureSection::of`]) with its settings type in its own folder, and every subcommand
//! checks each such section right after loading (`cli::checked`), so a wrong value still stops
//! it at start with the key named.

use super::Config;
use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A feature's section as written in the file (absent: null, the feature's defaults).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Section(serde_norway::Value);

impl Section {
    /// A section holding `settings` (a config built in code rather than read from a file).
    ///
    /// # Errors
    /// [`Error::ConfigValue`] naming `key` if `settings` has no YAML form.
    pub fn holding<T: Serialize>(key: &str, settings: &T) -> Result<Self> {
        serde_norway::to_value(settings)
            .map(Self)
            .map_err(|e| Error::ConfigValue {
                key: key.to_owned(),
                message: format!("has no YAML form: {e}"),
            })
    }
}

/// A feature's settings, read from its [`Section`] of a [`Config`].
pub trait FeatureSection: DeserializeOwned + Default {
    /// The section's key in the file.
    const KEY: &'static str;

    /// Where `config` keeps the section.
    fn section(config: &Config) -> &Section;

    /// The first value out of range, as [`Error::ConfigValue`] naming its key.
    ///
    /// # Errors
    /// As said.
    fn validate(&self) -> Result<()>;

    /// The settings of `config`: its defaults where the file has no such section.
    ///
    /// # Errors
    /// [`Error::ConfigParse`] for an unknown key or a wrong type (the message starts with the
    /// section's key), [`Error::ConfigValue`] for a value out of range.
    fn of(config: &Config) -> Result<Self> {
        let settings: Self = Self::section(config).read(Self::KEY)?;
        settings.validate()?;
        Ok(settings)
    }
}

impl Section {
    /// The section as a `T`, the section being at `key` in the file: `T`'s defaults where it is
    /// absent.
    ///
    /// # Errors
    /// [`Error::ConfigParse`] for an unknown key or a wrong type, the message starting with
    /// the key path of the wrong value (`checks.hugepages.min_free`).
    pub fn read<T: DeserializeOwned + Default>(&self, key: &str) -> Result<T> {
        let Section(yaml) = self;
        if yaml.is_null() {
            return Ok(T::default());
        }
        serde_path_to_error::deserialize(yaml.clone()).map_err(|e| {
            let key = match e.path().to_string().as_str() {
                "." => key.to_owned(),
                path => format!("{key}.{path}"),
            };
            let inner = e.into_inner().to_string();
            // A bounded duration already names its key (`config::duration`).
            let message = if inner.starts_with(&format!("{key}:")) {
                inner
            } else {
                format!("{key}: {inner}")
            };
            Error::ConfigParse {
                path: Default::default(),
                message,
            }
        })
    }
}
