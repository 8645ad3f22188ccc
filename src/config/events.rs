//! The `events:` section (docs/events.md): whether and how fast kernel events trigger probes.
//! Here, not in `agent::wakeup`, so the config floor needs no crate module above it.

use super::duration::{bounded_duration, parse_bounded_duration};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `events:` in the config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSettings {
    /// Listen to rtnetlink, uevents and verbs asynchronous events and probe at once on any
    /// of them. `false`: probe on the interval only.
    pub enabled: bool,
    /// After the first event, collect the others for this long, then probe once
    /// (humantime, 0ms to 1s).
    #[serde(with = "debounce")]
    pub debounce: Duration,
    /// Event-triggered probes are at least this far apart (humantime, 10ms to 60s).
    #[serde(with = "min_interval")]
    pub min_interval: Duration,
}

pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(30);
pub const DEFAULT_MIN_INTERVAL: Duration = Duration::from_millis(100);

impl Default for EventsSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            debounce: DEFAULT_DEBOUNCE,
            min_interval: DEFAULT_MIN_INTERVAL,
        }
    }
}

bounded_duration!(
    debounce,
    "events.debounce",
    Duration::ZERO,
    Duration::from_secs(1)
);
bounded_duration!(
    min_interval,
    "events.min_interval",
    Duration::from_millis(10),
    Duration::from_secs(60)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_bounded_and_named_in_errors() {
        let ok: EventsSettings =
            serde_norway::from_str("enabled: false\ndebounce: 0ms\nmin_interval: 1s\n").unwrap();
        assert!(!ok.enabled);
        assert_eq!(ok.debounce, Duration::ZERO);
        assert_eq!(ok.min_interval, Duration::from_secs(1));
        let e = serde_norway::from_str::<EventsSettings>("debounce: 2s\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("events.debounce") && e.contains("out of range"),
            "{e}"
        );
        let e = serde_norway::from_str::<EventsSettings>("min_interval: 1ms\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("events.min_interval"), "{e}");
        let e = serde_norway::from_str::<EventsSettings>("debounce: soon\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("events.debounce"), "{e}");
        assert!(serde_norway::from_str::<EventsSettings>("typo: 1\n").is_err());
        assert_eq!(
            serde_norway::from_str::<EventsSettings>("{}").unwrap(),
            EventsSettings::default()
        );
    }
}
