//! Bounded humantime durations, for config keys and CLI flags alike.

use std::time::Duration;

/// Parse a humantime duration within `[min, max]`; the message says what is accepted.
///
/// # Errors
/// A message naming the text and the bounds (the caller adds the key or flag).
pub fn parse_bounded_duration(
    text: &str,
    min: Duration,
    max: Duration,
) -> std::result::Result<Duration, String> {
    let range = || {
        format!(
            "between {} and {}",
            humantime::format_duration(min),
            humantime::format_duration(max)
        )
    };
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "{text:?} is not a duration ({e}); give one {} (e.g. \"5s\", \"1500ms\")",
            range()
        )
    })?;
    if d < min || d > max {
        return Err(format!(
            "{text:?} is out of range; give a duration {}",
            range()
        ));
    }
    Ok(d)
}

/// A YAML duration field with bounds: `bounded_duration!(module, "key.path", MIN, MAX)`.
/// serde_norway prefixes errors with the enclosing section only, so the message names the key.
macro_rules! bounded_duration {
    ($name:ident, $key:literal, $min:expr, $max:expr) => {
        mod $name {
            use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
            use std::time::Duration;

            pub const MIN: Duration = $min;
            pub const MAX: Duration = $max;

            pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&humantime::format_duration(*d).to_string())
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
                let text = String::deserialize(d)?;
                super::parse_bounded_duration(&text, MIN, MAX)
                    .map_err(|e| D::Error::custom(format!("{}: {e}", $key)))
            }
        }
    };
}
pub(crate) use bounded_duration;
