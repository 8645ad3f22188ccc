//! `fabricgate ping`: one peer, measured from every usable local port, as a table or JSON.

use crate::config::Config;
use crate::config::peers::PeerSpec;
use fabricgate_probes::rdma::RdmaReport;
use fabricgate_probes::rdma::peer::{self, ErrorKind, Identity, LocalPort, Outcome, Plan, Skip};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// What `fabricgate ping` measured from each local port.
#[derive(Debug, Clone)]
pub struct PingReport {
    pub peer: String,
    pub addr: Option<SocketAddr>,
    pub results: Vec<(LocalPort, Outcome)>,
    /// Why nothing could be measured (no usable local port, unresolvable peer).
    pub errors: Vec<String>,
}

/// `fabricgate ping` exit codes: 0 every port reached the peer, 1 the peer was unreachable
/// from some port (connect, timeout, verification, or refused), 3 nothing could be measured
/// here (no usable local port, local verbs failure).
impl PingReport {
    pub fn exit_code(&self) -> u8 {
        if self.results.is_empty() {
            return if self.addr.is_none() && !self.errors.is_empty() {
                crate::EXIT_NOT_VALIDATED
            } else {
                crate::EXIT_CANNOT_PROBE
            };
        }
        let local_only = self
            .results
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Failed { kind: None, .. }));
        if local_only {
            crate::EXIT_CANNOT_PROBE
        } else if self
            .results
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Measured(_)))
        {
            crate::EXIT_VALIDATED
        } else {
            crate::EXIT_NOT_VALIDATED
        }
    }

    pub fn to_json(&self) -> Value {
        let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
        let ports: Vec<Value> = self
            .results
            .iter()
            .map(|(local, o)| {
                let mut v = json!({
                    "device": local.device,
                    "port": local.port,
                    "ok": matches!(o, Outcome::Measured(_)),
                });
                match o {
                    Outcome::Measured(m) => {
                        v["peer_node"] = json!(m.peer_node);
                        v["peer_device"] = json!(m.peer_device);
                        v["peer_port"] = json!(m.peer_port);
                        v["rtt_count"] = json!(m.rtts.len());
                        v["rtt_us"] = json!({
                            "min": us(m.rtt_min()),
                            "p50": us(m.rtt_median()),
                            "p90": us(peer::percentile(&m.rtts, 0.9)),
                            "p99": us(peer::percentile(&m.rtts, 0.99)),
                            "max": us(m.rtt_max()),
                        });
                        v["bandwidth_bytes_per_second"] = json!(m.bandwidth);
                        v["bandwidth_bytes"] = json!(m.bw_bytes);
                        v["elapsed_ms"] = json!((m.elapsed.as_secs_f64() * 1e4).round() / 10.0);
                    }
                    Outcome::Skipped(s) => {
                        v["error_kind"] = Value::Null;
                        v["message"] = json!(match s {
                            Skip::SelfNode => "the peer is this node",
                            Skip::OtherGroup => "the peer is in another group (peers.match_label)",
                            Skip::Starting => "the peer's agent is starting; try again",
                            Skip::Busy => "the peer is busy with other sessions; try again",
                        });
                    }
                    Outcome::Failed { kind, message } => {
                        v["error_kind"] = json!(kind.map_or("local", ErrorKind::as_str));
                        v["message"] = json!(message);
                    }
                }
                v
            })
            .collect();
        json!({
            "peer": self.peer,
            "address": self.addr.map(|a| a.to_string()),
            "ok": self.exit_code() == crate::EXIT_VALIDATED,
            "ports": ports,
            "errors": self.errors,
        })
    }

    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let addr = self.addr.map_or_else(|| "?".to_owned(), |a| a.to_string());
        let _ = writeln!(
            out,
            "fabricgate ping {} ({addr}): {}",
            self.peer,
            if self.exit_code() == crate::EXIT_VALIDATED {
                "reachable"
            } else {
                "UNREACHABLE"
            }
        );
        for e in &self.errors {
            let _ = writeln!(out, "  ✗ {e}");
        }
        if self.results.is_empty() {
            return out;
        }
        let _ = writeln!(
            out,
            "  {:<12} {:<16} {:>10} {:>10} {:>10} {:>10} {:>12}  DETAIL",
            "LOCAL", "PEER", "RTT MIN", "RTT P50", "RTT P99", "RTT MAX", "BANDWIDTH"
        );
        let fmt = |d: Duration| {
            let us = d.as_secs_f64() * 1e6;
            if us >= 1_000.0 {
                format!("{:.2} ms", us / 1e3)
            } else {
                format!("{us:.1} µs")
            }
        };
        for (local, o) in &self.results {
            let here = format!("{}/{}", local.device, local.port);
            match o {
                Outcome::Measured(m) => {
                    let there = format!("{}/{}", m.peer_device, m.peer_port);
                    let bw = m.bandwidth.map_or_else(
                        || "-".to_owned(),
                        |b| {
                            if b >= 125e6 {
                                format!("{:.2} Gb/s", b * 8.0 / 1e9)
                            } else {
                                format!("{:.2} MB/s", b / 1e6)
                            }
                        },
                    );
                    let _ = writeln!(
                        out,
                        "  {here:<12} {there:<16} {:>10} {:>10} {:>10} {:>10} {bw:>12}  {} messages{}",
                        fmt(m.rtt_min()),
                        fmt(m.rtt_median()),
                        fmt(peer::percentile(&m.rtts, 0.99)),
                        fmt(m.rtt_max()),
                        m.rtts.len(),
                        if m.peer_node.is_empty() {
                            String::new()
                        } else {
                            format!(", node {}", m.peer_node)
                        }
                    );
                }
                Outcome::Skipped(s) => {
                    let _ = writeln!(out, "  {here:<12} skipped: {s:?}");
                }
                Outcome::Failed { kind, message } => {
                    let _ = writeln!(
                        out,
                        "  {here:<12} FAILED ({}): {message}",
                        kind.map_or("local", ErrorKind::as_str)
                    );
                }
            }
        }
        out
    }
}

/// Resolve `peer` and measure it from every usable local port (or only `device`), with the
/// pool's keys from `config.peers.key_file` (read only when there is something to measure).
///
/// # Errors
/// [`crate::Error::ConfigValue`] for `peers.key_file` when the key cannot be loaded.
pub fn ping(
    peer_text: &str,
    report: &RdmaReport,
    config: &Config,
    device: Option<&str>,
    identity: &Identity,
    plan: &Plan,
    timeout: Duration,
) -> crate::Result<PingReport> {
    let mut out = PingReport {
        peer: peer_text.to_owned(),
        addr: None,
        results: Vec::new(),
        errors: Vec::new(),
    };
    let spec = match PeerSpec::parse(peer_text, config.peers.port()) {
        Ok(s) => s,
        Err(e) => {
            out.errors.push(e);
            return Ok(out);
        }
    };
    match (spec.host.as_str(), spec.port)
        .to_socket_addrs()
        .map(|mut a| a.next())
    {
        Ok(Some(a)) => out.addr = Some(a),
        Ok(None) => out.errors.push(format!("{}: no address", spec.host)),
        Err(e) => out
            .errors
            .push(format!("cannot resolve {}: {e}", spec.host)),
    }
    let matcher = config.device_matcher();
    let ports = LocalPort::usable(report, &|d| {
        matcher.is_match(d) && device.is_none_or(|want| want == d)
    });
    if ports.is_empty() {
        let mut why =
            "no usable local RDMA port (up, opened by verbs, matching rdma.devices".to_owned();
        if let Some(d) = device {
            let _ = write!(why, " and --device {d}");
        }
        why.push_str("); run `fabricgate check` to see why");
        out.errors.push(why);
    }
    let Some(addr) = out.addr else {
        return Ok(out);
    };
    if ports.is_empty() {
        return Ok(out);
    }
    let keys = config.peers.load_keys()?.keys();
    for local in ports {
        let o = peer::measure(addr, &local, identity, &keys, plan, timeout);
        out.results.push((local, o));
    }
    Ok(out)
}
