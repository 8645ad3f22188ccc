//! The `peers:` section (docs/peers.md): what the agent's inter-node measurements may do, and
//! the peers written in it. Here, not in `peers`, so the config floor needs no crate module
//! above it; `peers` reads these types.

use crate::error::{Error, Result};
use fabricgate_probes::rdma::peer::{
    KeyRing, MAX_BW_DURATION, MAX_BW_SIZE, MAX_RTT_COUNT, MAX_RTT_SIZE, MIN_BW_SIZE, MIN_RTT_SIZE,
    Plan,
};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// Default TCP port of the responder (the metrics port + 1).
pub const DEFAULT_PORT: u16 = 9465;
/// Where the DaemonSet mounts the `fabricgate-peers` Secret's `key`.
pub const DEFAULT_KEY_FILE: &str = "/etc/fabricgate-peers/key";
/// How the operator creates the pool's key (in every message about a missing one).
pub const CREATE_KEY: &str = "kubectl -n fabricgate create secret generic fabricgate-peers \
     --from-literal=key=\"$(openssl rand -hex 32)\"";

/// The `peers:` section of the requirements file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeersSettings {
    /// Run the responder and the measurement rounds.
    pub enabled: bool,
    /// Address of the responder's TCP side channel (`--peers-listen` replaces it).
    pub listen: String,
    /// The pool's shared key(s) that authenticate the side channel: hex, one per line, the
    /// current one first (docs/peers.md). Re-read when it changes.
    pub key_file: String,
    /// Headless Service over the agent DaemonSet (`fabricgate-peers.fabricgate.svc`): its A
    /// records, resolved with the system resolver before every round, are the peers.
    pub service: String,
    /// Static peers, `host` or `host:port` (added to `--peers`).
    #[serde(rename = "static")]
    pub static_peers: Vec<String>,
    /// Peers measured per round (round-robin over the sorted peer list).
    pub per_round: u32,
    /// Time between rounds; empty: the agent's `--interval`.
    pub interval: String,
    /// Bound on one peer session, connect to verdict.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// RTT burst: messages and bytes per message.
    pub rtt_messages: u32,
    pub rtt_message_size: u32,
    pub bandwidth: BandwidthSettings,
    /// Node label key; only peers whose Node has the same value are measured (empty: all).
    pub match_label: String,
    /// Series of the peers measured in the last N rounds are exported; older ones removed.
    pub keep_rounds: u32,
    /// `off` or `N of the last M rounds`: the node is not ready unless in at least N of the
    /// last M rounds some peer was measured and verified.
    pub required: String,
}

impl Default for PeersSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: format!("0.0.0.0:{DEFAULT_PORT}"),
            key_file: DEFAULT_KEY_FILE.into(),
            service: String::new(),
            static_peers: Vec::new(),
            per_round: 3,
            interval: String::new(),
            timeout: Duration::from_secs(5),
            rtt_messages: 16,
            rtt_message_size: 64,
            bandwidth: BandwidthSettings::default(),
            match_label: String::new(),
            keep_rounds: 10,
            required: "off".into(),
        }
    }
}

/// `peers.bandwidth`: the optional RDMA WRITE burst.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BandwidthSettings {
    pub enabled: bool,
    /// Bytes per RDMA WRITE.
    pub message_size: u32,
    /// How long the burst writes.
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
}

impl Default for BandwidthSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            message_size: 65536,
            duration: Duration::from_millis(100),
        }
    }
}

mod humantime_serde {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(text.trim()).map_err(|e| {
            D::Error::custom(format!(
                "{text:?} is not a duration ({e}); write e.g. \"5s\" or \"100ms\""
            ))
        })
    }
}

/// `peers.required`: at least `n` good rounds among the last `m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Required {
    pub n: u32,
    pub m: u32,
}

impl FromStr for Required {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad =
            || format!("{s:?} is not a requirement; use \"off\" or \"N of the last M rounds\"");
        let words: Vec<&str> = s.split_whitespace().collect();
        let (n, m) = match words.as_slice() {
            [n, "of", "the", "last", m, "rounds" | "round"] | [n, "of", "last", m, "rounds"] => {
                (n, m)
            }
            _ => return Err(bad()),
        };
        match (n.parse::<u32>(), m.parse::<u32>()) {
            (Ok(n), Ok(m)) if n >= 1 && n <= m && m <= 1000 => Ok(Self { n, m }),
            _ => Err(bad()),
        }
    }
}

impl PeersSettings {
    /// The measurement plan these settings describe.
    pub fn plan(&self) -> Plan {
        Plan {
            rtt_size: self.rtt_message_size,
            rtt_count: self.rtt_messages,
            bw_size: if self.bandwidth.enabled {
                self.bandwidth.message_size
            } else {
                0
            },
            bw_duration: self.bandwidth.duration,
        }
    }

    /// `None` for `off`.
    pub fn required(&self) -> Option<Required> {
        self.required.parse().ok()
    }

    /// The responder's port (for peers given without one).
    pub fn port(&self) -> u16 {
        self.listen
            .parse::<SocketAddr>()
            .map_or(DEFAULT_PORT, |a| a.port())
    }

    /// The side channel's keys from `key_file`, re-read by path when it changes.
    ///
    /// # Errors
    /// [`Error::ConfigValue`] for `peers.key_file`, naming the file and how to create the
    /// Secret: peers are never run unauthenticated.
    pub fn load_keys(&self) -> Result<KeyRing> {
        KeyRing::load(std::path::Path::new(&self.key_file)).map_err(|e| Error::ConfigValue {
            key: "peers.key_file".into(),
            message: format!(
                "{e}. peers.enabled needs the pool's shared key: create it once with \
                 `{CREATE_KEY}` (the DaemonSet mounts it at {DEFAULT_KEY_FILE}), or point \
                 peers.key_file at a file holding one or two hex keys"
            ),
        })
    }

    /// Round interval: `peers.interval`, or `fallback` (the agent's `--interval`).
    pub fn interval(&self, fallback: Duration) -> Duration {
        humantime::parse_duration(self.interval.trim()).unwrap_or(fallback)
    }

    /// # Errors
    /// [`Error::ConfigValue`] naming the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::ConfigValue {
                key: format!("peers.{key}"),
                message,
            })
        };
        if self.listen.parse::<SocketAddr>().is_err() {
            return bad(
                "listen",
                format!(
                    "{:?} is not an address; write e.g. \"0.0.0.0:9465\"",
                    self.listen
                ),
            );
        }
        if self.key_file.trim().is_empty() {
            return bad(
                "key_file",
                format!("is empty; the side channel needs a key (default {DEFAULT_KEY_FILE})"),
            );
        }
        if self.per_round == 0 || self.per_round > 64 {
            return bad(
                "per_round",
                format!("{} is not between 1 and 64 (default 3)", self.per_round),
            );
        }
        if !self.interval.trim().is_empty() {
            match humantime::parse_duration(self.interval.trim()) {
                Ok(d) if d >= Duration::from_secs(1) => {}
                _ => {
                    return bad(
                        "interval",
                        format!(
                            "{:?} is not a duration of at least 1s (e.g. \"30s\")",
                            self.interval
                        ),
                    );
                }
            }
        }
        if self.timeout < Duration::from_millis(100) || self.timeout > Duration::from_secs(60) {
            return bad(
                "timeout",
                format!(
                    "{} is not between 100ms and 60s",
                    humantime::format_duration(self.timeout)
                ),
            );
        }
        if !(MIN_RTT_SIZE..=MAX_RTT_SIZE).contains(&self.rtt_message_size) {
            return bad(
                "rtt_message_size",
                format!(
                    "{} is not between {MIN_RTT_SIZE} and {MAX_RTT_SIZE} bytes",
                    self.rtt_message_size
                ),
            );
        }
        if !(1..=MAX_RTT_COUNT).contains(&self.rtt_messages) {
            return bad(
                "rtt_messages",
                format!("{} is not between 1 and {MAX_RTT_COUNT}", self.rtt_messages),
            );
        }
        if !(MIN_BW_SIZE..=MAX_BW_SIZE).contains(&self.bandwidth.message_size) {
            return bad(
                "bandwidth.message_size",
                format!(
                    "{} is not between {MIN_BW_SIZE} and {MAX_BW_SIZE} bytes",
                    self.bandwidth.message_size
                ),
            );
        }
        if self.bandwidth.duration.is_zero() || self.bandwidth.duration > MAX_BW_DURATION {
            return bad(
                "bandwidth.duration",
                format!(
                    "{} is not between 1ms and {}",
                    humantime::format_duration(self.bandwidth.duration),
                    humantime::format_duration(MAX_BW_DURATION)
                ),
            );
        }
        if self.keep_rounds == 0 || self.keep_rounds > 1000 {
            return bad(
                "keep_rounds",
                format!("{} is not between 1 and 1000", self.keep_rounds),
            );
        }
        if self.required.trim() != "off"
            && let Err(e) = self.required.parse::<Required>()
        {
            return bad("required", e);
        }
        for (i, p) in self.static_peers.iter().enumerate() {
            if let Err(e) = PeerSpec::parse(p, DEFAULT_PORT) {
                return bad(&format!("static[{i}]"), e);
            }
        }
        if !self.service.is_empty() && self.service.contains(['/', ' ', ':']) {
            return bad(
                "service",
                format!(
                    "{:?} is not a DNS name; give the headless Service's name \
                     (e.g. \"fabricgate-peers.fabricgate.svc.cluster.local\")",
                    self.service
                ),
            );
        }
        Ok(())
    }
}

/// One peer as configured: a host (name or address) and a port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerSpec {
    pub host: String,
    pub port: u16,
}

impl PeerSpec {
    /// `host`, `host:port`, `a.b.c.d:port`, `[v6]:port` or a bare IPv6 address.
    ///
    /// # Errors
    /// A message saying what is wrong with `text`.
    pub fn parse(text: &str, default_port: u16) -> std::result::Result<Self, String> {
        let t = text.trim();
        if t.is_empty() || t.contains(char::is_whitespace) || t.contains('/') {
            return Err(format!("{text:?} is not host or host:port"));
        }
        if let Ok(a) = t.parse::<SocketAddr>() {
            return Ok(Self {
                host: a.ip().to_string(),
                port: a.port(),
            });
        }
        if let Ok(ip) = t.parse::<std::net::IpAddr>() {
            return Ok(Self {
                host: ip.to_string(),
                port: default_port,
            });
        }
        match t.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| format!("{text:?}: {port:?} is not a port"))?;
                if host.is_empty() {
                    return Err(format!("{text:?} has no host"));
                }
                Ok(Self {
                    host: host.to_owned(),
                    port,
                })
            }
            Some(_) => Err(format!(
                "{text:?}: write an IPv6 address with a port as [addr]:port"
            )),
            None => Ok(Self {
                host: t.to_owned(),
                port: default_port,
            }),
        }
    }

    /// The `peer` label: the host, with `:port` only when it is not the default port.
    pub fn label(&self, default_port: u16) -> String {
        if self.port == default_port {
            self.host.clone()
        } else if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn defaults_are_off_and_valid() {
        let s = PeersSettings::default();
        assert!(!s.enabled);
        assert_eq!(s.per_round, 3);
        assert_eq!(s.port(), 9465);
        assert!(s.validate().is_ok());
        assert_eq!(s.required(), None);
        assert_eq!(s.plan().bw_size, 0, "bandwidth burst off by default");
        assert_eq!(s.interval(Duration::from_secs(10)), Duration::from_secs(10));
    }

    #[test]
    fn required_parses_n_of_the_last_m_rounds() {
        assert_eq!(
            "2 of the last 5 rounds".parse::<Required>(),
            Ok(Required { n: 2, m: 5 })
        );
        for bad in [
            "",
            "on",
            "5 of the last 2 rounds",
            "0 of the last 3 rounds",
            "2 of 5",
        ] {
            assert!(bad.parse::<Required>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        for (yaml, key) in [
            ("peers:\n  per_round: 0\n", "peers.per_round"),
            ("peers:\n  listen: nowhere\n", "peers.listen"),
            (
                "peers:\n  rtt_message_size: 100000\n",
                "peers.rtt_message_size",
            ),
            ("peers:\n  rtt_messages: 1000\n", "peers.rtt_messages"),
            (
                "peers:\n  bandwidth:\n    duration: 10s\n",
                "peers.bandwidth.duration",
            ),
            (
                "peers:\n  bandwidth:\n    message_size: 1\n",
                "peers.bandwidth.message_size",
            ),
            ("peers:\n  required: sometimes\n", "peers.required"),
            ("peers:\n  static: [\"a b\"]\n", "peers.static[0]"),
            ("peers:\n  interval: 10ms\n", "peers.interval"),
            ("peers:\n  timeout: 1ms\n", "peers.timeout"),
            ("peers:\n  service: \"http://x\"\n", "peers.service"),
            ("peers:\n  keep_rounds: 0\n", "peers.keep_rounds"),
            ("peers:\n  key_file: \"\"\n", "peers.key_file"),
        ] {
            let e = Config::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(key), "{yaml:?}: {e}");
        }
        let e = Config::parse("peers:\n  per_rnd: 2\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("per_rnd"), "{e}");
        let c = Config::parse(
            "peers:\n  enabled: true\n  static: [\"10.0.0.2\", \"node-b:7000\"]\n  \
             required: 2 of the last 4 rounds\n  bandwidth:\n    enabled: true\n    \
             duration: 50ms\n",
        )
        .unwrap();
        assert!(c.peers.enabled);
        assert_eq!(c.peers.required(), Some(Required { n: 2, m: 4 }));
        assert_eq!(c.peers.plan().bw_size, 65536);
        assert_eq!(c.peers.plan().bw_duration, Duration::from_millis(50));
    }

    #[test]
    fn a_missing_key_file_names_it_and_how_to_create_the_secret() {
        let dir = tempfile::tempdir().unwrap();
        let s = PeersSettings {
            enabled: true,
            key_file: dir.path().join("key").display().to_string(),
            ..PeersSettings::default()
        };
        let e = s.load_keys().unwrap_err();
        assert_eq!(e.exit_code(), crate::EXIT_USAGE);
        let e = e.to_string();
        for want in [
            "peers.key_file",
            &s.key_file,
            "create secret generic fabricgate-peers",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        std::fs::write(&s.key_file, "00112233445566778899aabbccddeeff\n").unwrap();
        assert_eq!(s.load_keys().unwrap().keys().len(), 1);
    }

    #[test]
    fn peer_specs_parse_and_label() {
        let p = |t| PeerSpec::parse(t, 9465);
        assert_eq!(p("10.0.0.2").unwrap().label(9465), "10.0.0.2");
        assert_eq!(p("10.0.0.2:9465").unwrap().label(9465), "10.0.0.2");
        assert_eq!(p("10.0.0.2:7000").unwrap().label(9465), "10.0.0.2:7000");
        assert_eq!(p("node-b").unwrap().port, 9465);
        assert_eq!(p("node-b:7000").unwrap().host, "node-b");
        assert_eq!(p("[fe80::1]:7000").unwrap().label(9465), "[fe80::1]:7000");
        assert_eq!(p("fe80::1").unwrap().port, 9465);
        for bad in ["", "a b", "host:0", "host:http", ":9465", "http://x"] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }
}
