//! What a [`crate::collect::Collector`] finds in one probe: a [`Fact`] (its typed value, shown
//! as JSON only when printed, and its probe's errors), and the report's [`Facts`] by key.

use serde::{Serialize, Serializer};
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// What one collector found in one probe: its typed value (read back with [`Fact::get`]),
/// shown as JSON only when `check` prints it, and the errors of its probe.
#[derive(Clone)]
pub struct Fact {
    /// The collector's name (set by the prober).
    probe: &'static str,
    value: Arc<dyn FactValue>,
    errors: Vec<String>,
}

/// A collected value: read back by type, shown as JSON, debug-printed.
trait FactValue: Any + Send + Sync {
    fn as_any(&self) -> &dyn Any;
    fn to_json(&self) -> serde_json::Value;
    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;
}

impl<T: Serialize + fmt::Debug + Send + Sync + 'static> FactValue for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self)
            .unwrap_or_else(|e| serde_json::Value::String(format!("not shown: {e}")))
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Fact {
    pub fn new<T: Serialize + fmt::Debug + Send + Sync + 'static>(value: T) -> Self {
        Self {
            probe: "",
            value: Arc::new(value),
            errors: Vec::new(),
        }
    }

    /// With the errors of its probe (each naming the path and what to do).
    pub fn with_errors(mut self, errors: Vec<String>) -> Self {
        self.errors = errors;
        self
    }

    /// As collected by the collector named `probe`.
    pub fn from_probe(mut self, probe: &'static str) -> Self {
        self.probe = probe;
        self
    }

    /// The name of the collector that found it.
    pub fn probe(&self) -> &'static str {
        self.probe
    }

    /// The value, when it is a `T`.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.value.as_any().downcast_ref()
    }

    pub fn errors(&self) -> &[String] {
        &self.errors
    }
}

impl fmt::Debug for Fact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Value<'a>(&'a dyn FactValue);
        impl fmt::Debug for Value<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.debug(f)
            }
        }
        f.debug_struct("Fact")
            .field("probe", &self.probe)
            .field("value", &Value(&*self.value))
            .field("errors", &self.errors)
            .finish()
    }
}

impl Serialize for Fact {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.to_json().serialize(s)
    }
}

/// The facts of one probe, by their keys in the report.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(transparent)]
pub struct Facts(BTreeMap<&'static str, Fact>);

impl Facts {
    pub fn insert(&mut self, key: &'static str, fact: Fact) {
        self.0.insert(key, fact);
    }

    pub fn fact(&self, key: &str) -> Option<&Fact> {
        self.0.get(key)
    }

    /// The value at `key`, when its collector ran and its value is a `T`.
    pub fn get<T: 'static>(&self, key: &str) -> Option<&T> {
        self.fact(key)?.get()
    }

    /// The fact the collector named `probe` found.
    pub fn of_probe(&self, probe: &str) -> Option<&Fact> {
        self.0.values().find(|f| f.probe == probe)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &Fact)> {
        self.0.iter().map(|(k, v)| (*k, v))
    }
}

/// The report's own keys and the built-in probes' names, which no collector may take.
pub const RESERVED_NAMES: &[&str] = &["timestamp", "rdma", "timings", "rdma_sysfs", "rdma_verbs"];

/// Whether `name` can name a collector or its key: `[a-z_]+`, not one of [`RESERVED_NAMES`].
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        && !RESERVED_NAMES.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, PartialEq, Debug)]
    struct Pages {
        free: Option<u64>,
    }

    #[test]
    fn a_fact_reads_back_as_its_type_and_shows_as_json() {
        let mut facts = Facts::default();
        facts.insert(
            "hugepages",
            Fact::new(Pages { free: Some(3) })
                .with_errors(vec!["x".into()])
                .from_probe("pages"),
        );
        assert_eq!(
            facts.get::<Pages>("hugepages"),
            Some(&Pages { free: Some(3) })
        );
        assert_eq!(facts.get::<u64>("hugepages"), None, "another type");
        assert_eq!(facts.get::<Pages>("other"), None);
        assert_eq!(
            facts.of_probe("pages").map(Fact::errors),
            Some(&["x".to_owned()][..])
        );
        assert!(
            facts.of_probe("hugepages").is_none(),
            "by its collector's name"
        );
        let json = serde_json::to_value(&facts).unwrap();
        assert_eq!(json, serde_json::json!({"hugepages": {"free": 3}}));
    }

    #[test]
    fn names_are_lowercase_words_and_not_the_reports_own() {
        assert!(valid_name("hugepages"));
        assert!(valid_name("kernel_modules"));
        for bad in ["", "Huge", "a-b", "rdma", "timings", "rdma_verbs", "x1"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
