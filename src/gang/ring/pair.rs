//! One pair of the ring, measured once (synchronous: it runs on a blocking thread): RTT over
//! RDMA from every usable local port (rail) to the peer's port of the same name, all required
//! (with a bandwidth burst when the check asks for a minimum, and the check's RTT ceiling),
//! or, without a usable local port, the authenticated side-channel exchange alone. Whatever
//! happens is a [`PairResult`]: our own trouble is `ok: false` with an error that says it is
//! ours, never a verdict on the Node.

use crate::gang::fabriccheck::{Member, PairResult, RailResult, Rdma};
use fabricgate_probes::rdma::peer::{self, Identity, Keys, LocalPort, Outcome, Plan, Skip};
use k8s_openapi::jiff::Timestamp;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Wait between tries while the peer says BUSY or STARTING.
const BUSY_RETRY: Duration = Duration::from_millis(200);

/// What one pair needs.
pub struct PairJob<'a> {
    pub me: &'a Identity,
    pub peer: &'a Member,
    /// Usable local ports; empty: only the side channel is tested (`rdma: unmeasured`).
    pub ports: &'a [LocalPort],
    pub keys: &'a Keys,
    /// The RTT plan, with the bandwidth burst already set when a minimum is asked.
    pub plan: Plan,
    pub min_bandwidth_gbps: Option<f64>,
    /// Every rail's median RTT must stay below this (µs).
    pub max_rtt_micros: Option<f64>,
    /// When to give up (the check's deadline, or sooner).
    pub until: Instant,
    /// Bound on one session.
    pub session: Duration,
    /// This node's own address (its responder's), to connect from: the peer's responder
    /// keeps places for its ring predecessor's address. `None`: the route's source.
    pub source: Option<IpAddr>,
    /// The check's uid, told to the peer's responder with each session so that it attests
    /// what it received.
    pub check_uid: &'a str,
}

fn finish(job: &PairJob<'_>, rdma: Rdma) -> PairResult {
    PairResult {
        node: job.me.node_name.clone(),
        peer: job.peer.node.clone(),
        ok: false,
        rdma,
        device: None,
        port: None,
        rtt_micros: None,
        bandwidth_gbps: None,
        error: None,
        finished_at: Timestamp::now().to_string(),
        received: None,
        rails: Vec::new(),
    }
}

fn fail(mut r: PairResult, error: String) -> PairResult {
    r.ok = false;
    r.error = Some(error);
    r
}

/// Measure the pair once. Never panics; bounded by `job.until`.
pub fn measure_pair(job: &PairJob<'_>) -> PairResult {
    let rdma = if job.ports.is_empty() {
        Rdma::Unmeasured
    } else {
        Rdma::Measured
    };
    let result = finish(job, rdma);
    let who = format!("peer {} ({})", job.peer.node, job.peer.endpoint);
    if job.keys.is_empty() {
        return fail(
            result,
            format!(
                "local: this agent has no peers key (peers.key_file), so it cannot talk to \
                 {who}; mount the fabricgate-peers Secret"
            ),
        );
    }
    let addr: SocketAddr = match job.peer.endpoint.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(a)) => a,
        Ok(None) | Err(_) => {
            return fail(
                result,
                format!(
                    "connect: {who}: the endpoint is not host:port (its Node's \
                     fabricgate.io/peers-endpoint annotation)"
                ),
            );
        }
    };
    if job.ports.is_empty() {
        return greet_only(job, result, addr, &who);
    }
    // The Node dialled, as it publishes itself: its responder must answer as it, from one of
    // its own ports.
    let mut pin = peer::Pin::new(&job.peer.node, &job.peer.gids);
    let rails = u8::try_from(job.ports.len()).unwrap_or(u8::MAX);
    // Every rail, to the peer's port of the same name, all required.
    let mut measured = Vec::with_capacity(job.ports.len());
    for (rail, local) in job.ports.iter().enumerate() {
        pin.tag = peer::CheckTag::new(job.check_uid, u8::try_from(rail).unwrap_or(u8::MAX), rails)
            .unwrap_or_default();
        measured.push(measure_rail(job, addr, local, &pin, &who));
    }
    fold_rails(result, measured)
}

/// One rail: `local` to the peer's port of the same name, against the check's floor and
/// ceiling.
fn measure_rail(
    job: &PairJob<'_>,
    addr: SocketAddr,
    local: &LocalPort,
    pin: &peer::Pin,
    who: &str,
) -> RailResult {
    let mut r = RailResult {
        device: local.device.clone(),
        port: local.port,
        ..RailResult::default()
    };
    let outcome = loop {
        let left = job.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break None;
        }
        let o = peer::measure_pinned(
            job.source,
            addr,
            local,
            job.me,
            job.keys,
            &job.plan,
            job.session.min(left),
            Some(pin),
        );
        match o {
            Outcome::Skipped(Skip::Busy | Skip::Starting) => std::thread::sleep(BUSY_RETRY),
            o => break Some(o),
        }
    };
    let from = format!("from {}/{}", local.device, local.port);
    let error = match outcome {
        None => Some(format!(
            "timeout: {who} {from}: busy or starting until the check's deadline"
        )),
        Some(Outcome::Measured(m)) if m.peer_node != job.peer.node => {
            Some(wrong_node(who, &m.peer_node))
        }
        Some(Outcome::Measured(m)) => {
            let rtt = (m.rtt_median().as_secs_f64() * 1e7).round() / 10.0;
            r.rtt_micros = Some(rtt);
            r.bandwidth_gbps = m.bandwidth.map(|b| (b * 8.0 / 1e9 * 100.0).round() / 100.0);
            match (job.min_bandwidth_gbps, r.bandwidth_gbps, job.max_rtt_micros) {
                (Some(min), Some(got), _) if got < min => Some(format!(
                    "bandwidth: {who} {from}: {got} Gb/s, below the {min} Gb/s asked"
                )),
                (Some(min), None, _) => Some(format!(
                    "bandwidth: {who} {from}: no burst ran ({min} Gb/s asked)"
                )),
                (_, _, Some(max)) if rtt > max => Some(format!(
                    "rtt: {who} {from}: median {rtt} µs, above the {max} µs ceiling"
                )),
                _ => None,
            }
        }
        Some(Outcome::Skipped(s)) => Some(refused(who, s)),
        Some(Outcome::Failed { kind, message }) => {
            let kind = kind.map_or("local", peer::ErrorKind::as_str);
            Some(format!("{kind}: {who} {from}: {message}"))
        }
    };
    r.ok = error.is_none();
    r.error = error;
    r
}

/// Pure: the pair's answer from its rails: `ok` only when every rail is (and there is one);
/// device, port and error of the first failed rail (the first rail when none failed), the
/// slowest median RTT and the lowest bandwidth.
pub(crate) fn fold_rails(mut result: PairResult, rails: Vec<RailResult>) -> PairResult {
    let failed: Vec<&RailResult> = rails.iter().filter(|r| !r.ok).collect();
    let shown = failed.first().copied().or(rails.first());
    result.device = shown.map(|r| r.device.clone());
    result.port = shown.map(|r| r.port);
    result.rtt_micros = rails.iter().filter_map(|r| r.rtt_micros).reduce(f64::max);
    result.bandwidth_gbps = rails
        .iter()
        .filter_map(|r| r.bandwidth_gbps)
        .reduce(f64::min);
    result.ok = !rails.is_empty() && failed.is_empty();
    result.error = match failed.as_slice() {
        [] if rails.is_empty() => Some("local: no local port to measure from".to_owned()),
        [] => None,
        [one] => one.error.clone(),
        [first, rest @ ..] => Some(format!(
            "{} (and {} more of {} rails failed)",
            first.error.as_deref().unwrap_or("failed"),
            rest.len(),
            rails.len()
        )),
    };
    result.rails = rails;
    result
}

/// No usable local port: the authenticated HELLO/WELCOME with the peer's responder decides.
fn greet_only(job: &PairJob<'_>, result: PairResult, addr: SocketAddr, who: &str) -> PairResult {
    let mut pin = peer::Pin::new(&job.peer.node, &job.peer.gids);
    pin.tag = peer::CheckTag::new(job.check_uid, 0, 1).unwrap_or_default();
    loop {
        let left = job.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return fail(
                result,
                format!("timeout: {who}: busy or starting until the check's deadline"),
            );
        }
        // No port asked for: the responder answers for one of its own.
        let options = peer::GreetOptions {
            source: job.source,
            pin: Some(&pin),
            timeout: job.session.min(left),
            local: None,
        };
        match peer::greet(addr, job.me, job.keys, &options) {
            // WELCOME must name the Node dialled: an empty name is no one's.
            Ok(g) if g.peer_node != job.peer.node => {
                return fail(result, wrong_node(who, &g.peer_node));
            }
            Ok(_) => return PairResult { ok: true, ..result },
            Err(Outcome::Skipped(Skip::Busy | Skip::Starting)) => std::thread::sleep(BUSY_RETRY),
            Err(Outcome::Skipped(s)) => return fail(result, refused(who, s)),
            Err(Outcome::Failed { kind, message }) => {
                let kind = kind.map_or("local", peer::ErrorKind::as_str);
                return fail(result, format!("{kind}: {who}: {message}"));
            }
            Err(Outcome::Measured(_)) => return PairResult { ok: true, ..result },
        }
    }
}

fn wrong_node(who: &str, answered: &str) -> String {
    format!(
        "verification: {who}: the responder there answered as {}: a stale \
         fabricgate.io/peers-endpoint annotation, or not that node's agent",
        peer::answered_as(answered)
    )
}

fn refused(who: &str, s: Skip) -> String {
    match s {
        Skip::SelfNode => format!(
            "refused: {who}: the responder there is this node's own (a wrong \
             fabricgate.io/peers-endpoint annotation?)"
        ),
        Skip::OtherGroup => {
            format!("refused: {who}: the peer is in another group (peers.match_label)")
        }
        Skip::Busy | Skip::Starting => format!("timeout: {who}: busy or starting"),
    }
}
