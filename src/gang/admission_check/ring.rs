//! What the answers to a FabricCheck say about the gang's ring: every pair measured by its
//! sender and attested by its receiver, within the floors asked for (`assess_ring`).

use super::decide::list;
use crate::gang::fabriccheck::{CheckSpec, PairResult, Rdma};
use std::fmt::Write as _;

/// What the answers to a FabricCheck say about its ring (the check's state, `Ready` or
/// `Retry`, follows from it in `step.rs`).
#[derive(Debug, Clone, PartialEq)]
pub enum RingOutcome {
    /// Members have not all answered and the deadline has not passed.
    Waiting,
    /// Every pair is good: the message for `Ready`.
    Passed(String),
    /// A pair failed, or a member did not answer in time.
    Failed {
        message: String,
        failed_pairs: usize,
    },
}

/// Assess a FabricCheck's answers: `Waiting` until every member answered or `past_deadline`;
/// then every pair good -> `Passed`, else `Failed` naming the failed pairs (with port and
/// error) and the members that did not answer. A pair is good when `ok` and measured over RDMA
/// (or only `ok`, with `require_rdma` off), at the bandwidth asked for, and its receiving end
/// attests it: the next member's answer says it received from this one, verified.
pub fn assess_ring(
    spec: &CheckSpec,
    results: &[PairResult],
    past_deadline: bool,
    require_rdma: bool,
    timeout: std::time::Duration,
) -> RingOutcome {
    let n = spec.members.len();
    let mut failed = Vec::new();
    let mut missing = Vec::new();
    let mut unmeasured = 0usize;
    let mut worst_rtt: Option<f64> = None;
    for (i, m) in spec.members.iter().enumerate() {
        let peer = &spec.members[(i + 1) % n.max(1)].node;
        let Some(r) = results.iter().find(|r| r.node == m.node) else {
            missing.push(m.node.clone());
            continue;
        };
        // Both ends of the pair: the sender's measurement and the receiver's own attestation
        // of what arrived. A receiver that has not answered is waited for
        // (or named as silent at the deadline).
        let receiver = results.iter().find(|x| &x.node == peer);
        let problem = pair_problem(r, peer, spec, require_rdma)
            .or_else(|| receiver.and_then(|x| receipt_problem(r, x)));
        match problem {
            Some(p) => failed.push(p),
            None => {
                if r.rdma != Rdma::Measured {
                    unmeasured += 1;
                }
                if let Some(rtt) = r.rtt_micros {
                    worst_rtt = Some(worst_rtt.map_or(rtt, |w: f64| w.max(rtt)));
                }
            }
        }
    }
    if !missing.is_empty() && !past_deadline {
        return RingOutcome::Waiting;
    }
    if !failed.is_empty() {
        let mut message = format!(
            "gang RDMA pre-flight failed on {} of {n} pairs: {}",
            failed.len(),
            list(&failed)
        );
        if !missing.is_empty() {
            let _ = write!(message, "; no result from {}", list(&missing));
        }
        return RingOutcome::Failed {
            message,
            failed_pairs: failed.len(),
        };
    }
    if !missing.is_empty() {
        return RingOutcome::Failed {
            message: format!(
                "gang RDMA pre-flight timed out after {}: no result from {} of {n} members: {} \
                 (their agents are not running, have gang checks or peers off, or cannot \
                 create their FabricCheckResult)",
                humantime::format_duration(timeout),
                missing.len(),
                list(&missing)
            ),
            failed_pairs: 0,
        };
    }
    let mut message = format!("gang RDMA pre-flight passed: {n} pairs in a ring over {n} nodes");
    if let Some(w) = worst_rtt {
        let _ = write!(message, ", slowest median RTT {w:.1} µs");
    }
    if let Some(min) = spec.min_bandwidth_gbps {
        let _ = write!(message, ", every pair at least {min} Gbit/s");
    }
    if let Some(max) = spec.max_rtt_micros {
        let _ = write!(message, ", every median RTT at most {max} µs");
    }
    if unmeasured > 0 {
        let _ = write!(
            message,
            "; gang.require_rdma is false: {unmeasured} pairs answered over the side channel \
             only, without an RDMA measurement"
        );
    }
    RingOutcome::Passed(message)
}

/// Why the receiving end `receiver` does not attest the pair `sender` measured: no attestation,
/// one of another member, nothing verified, or no RDMA bytes where the sender claims RDMA.
fn receipt_problem(sender: &PairResult, receiver: &PairResult) -> Option<String> {
    let pair = format!("{} -> {}", sender.node, receiver.node);
    let Some(got) = &receiver.received else {
        return Some(format!(
            "{pair}: {} does not attest its receiving end (its answer has no `received`: an \
             older agent?); a pair needs both ends",
            receiver.node
        ));
    };
    if got.peer != sender.node {
        return Some(format!(
            "{pair}: {} attests receiving from {}, not from {}",
            receiver.node, got.peer, sender.node
        ));
    }
    if !got.ok {
        let why = got.error.as_deref().unwrap_or("nothing verified");
        return Some(format!(
            "{pair}: the ends disagree: {} reports ok, {} received nothing verified ({why})",
            sender.node, receiver.node
        ));
    }
    if sender.rdma == Rdma::Measured && got.rdma != Rdma::Measured {
        return Some(format!(
            "{pair}: the ends disagree: {} reports an RDMA measurement, {} saw no RDMA bytes \
             from it (the side channel only)",
            sender.node, receiver.node
        ));
    }
    // Every rail the sender reports arrived verified at the receiver.
    let verified = got
        .rails
        .iter()
        .filter(|x| x.ok && x.bytes.is_some())
        .count();
    if sender.rdma == Rdma::Measured && verified < sender.rails.len() {
        return Some(format!(
            "{pair}: the ends disagree: {} reports {} rails, {} verified the bytes of {verified}",
            sender.node,
            sender.rails.len(),
            receiver.node
        ));
    }
    None
}

/// Why one member's result is not good, naming the pair, the port and the error.
fn pair_problem(
    r: &PairResult,
    peer: &str,
    spec: &CheckSpec,
    require_rdma: bool,
) -> Option<String> {
    let port = match (&r.device, r.port) {
        (Some(d), Some(p)) => format!(" ({d} port {p})"),
        (Some(d), None) => format!(" ({d})"),
        _ => String::new(),
    };
    let pair = format!("{} -> {peer}{port}", r.node);
    if r.peer != peer {
        return Some(format!(
            "{pair}: measured {} instead of its ring neighbour",
            r.peer
        ));
    }
    if !r.ok {
        let error = r.error.as_deref().unwrap_or("failed (no error given)");
        return Some(format!("{pair}: {error}"));
    }
    if require_rdma && r.rdma != Rdma::Measured {
        return Some(format!(
            "{pair}: RDMA was not measured (unmeasured; gang.require_rdma is true)"
        ));
    }
    // Every rail, and the floor and ceiling on the slowest: for what was measured over RDMA
    // (side-channel answers, allowed without gang.require_rdma, carry neither).
    if let Some(bad) = r.rails.iter().find(|x| !x.ok) {
        let error = bad.error.as_deref().unwrap_or("failed (no error given)");
        return Some(format!(
            "{} -> {peer}: rail {} port {}: {error}",
            r.node, bad.device, bad.port
        ));
    }
    if r.rdma != Rdma::Measured {
        return None;
    }
    if let Some(min) = spec.min_bandwidth_gbps {
        match r.bandwidth_gbps {
            Some(b) if b >= min => {}
            Some(b) => return Some(format!("{pair}: bandwidth {b:.1} Gbit/s below {min}")),
            None => return Some(format!("{pair}: no bandwidth measured (asked for {min})")),
        }
    }
    if let Some(max) = spec.max_rtt_micros {
        match r.rtt_micros {
            Some(t) if t <= max => {}
            Some(t) => {
                return Some(format!(
                    "{pair}: median RTT {t:.1} µs above the ceiling {max} µs (gang.max_rtt_micros)"
                ));
            }
            None => return Some(format!("{pair}: no RTT measured (ceiling {max} µs)")),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gang::fabriccheck::{Member, Received};
    use std::time::Duration;

    struct St {
        results: Vec<PairResult>,
    }

    fn spec(n: usize) -> CheckSpec {
        CheckSpec {
            members: (0..n)
                .map(|i| Member {
                    node: format!("n{i}"),
                    endpoint: format!("10.0.0.{i}:9465"),
                    ..Member::default()
                })
                .collect(),
            ..CheckSpec::default()
        }
    }

    fn result(i: usize, n: usize, ok: bool) -> PairResult {
        PairResult {
            node: format!("n{i}"),
            peer: format!("n{}", (i + 1) % n),
            ok,
            rdma: Rdma::Measured,
            device: Some("mlx5_0".into()),
            port: Some(1),
            rtt_micros: Some(10.0 + i as f64),
            error: (!ok).then(|| "timeout: no completion from n2 mlx5_0 port 1".into()),
            received: Some(Received {
                peer: format!("n{}", (i + n - 1) % n),
                ok: true,
                rdma: Rdma::Measured,
                ..Received::default()
            }),
            ..PairResult::default()
        }
    }

    /// A pair is vouched for by both its ends. The sender's `ok: true` is
    /// not enough when the receiver attests nothing, something else, a failure, or only a
    /// side-channel greeting where the sender claims RDMA.
    #[test]
    fn redteam_a_pair_needs_both_ends_to_agree() {
        let t = Duration::from_secs(20);
        let s = spec(2);
        let good = vec![result(0, 2, true), result(1, 2, true)];
        assert!(matches!(
            assess_ring(&s, &good, false, true, t),
            RingOutcome::Passed(_)
        ));
        let retry = |rs: &[PairResult]| match assess_ring(&s, rs, false, true, t) {
            RingOutcome::Failed {
                message,
                failed_pairs: 1,
            } => message,
            v => panic!("{v:?}"),
        };
        let mut rs = good.clone();
        rs[1].received = Some(Received {
            peer: "n0".into(),
            ok: false,
            error: Some("nothing received from n0 for this check".into()),
            ..Received::default()
        });
        let m = retry(&rs);
        assert!(
            m.contains("n0 -> n1: the ends disagree: n0 reports ok, n1 received nothing verified")
                && m.contains("nothing received from n0"),
            "{m}"
        );
        rs[1].received = None;
        assert!(retry(&rs).contains("n0 -> n1: n1 does not attest its receiving end"));
        rs[1].received = Some(Received {
            peer: "n7".into(),
            ok: true,
            ..Received::default()
        });
        assert!(retry(&rs).contains("n0 -> n1: n1 attests receiving from n7, not from n0"));
        rs[1].received = Some(Received {
            peer: "n0".into(),
            ok: true,
            rdma: Rdma::Unmeasured,
            ..Received::default()
        });
        assert!(retry(&rs).contains("n0 reports an RDMA measurement, n1 saw no RDMA bytes"));
    }

    #[test]
    fn assess_ring_waits_then_decides_never_ready_on_timeout() {
        let t = Duration::from_secs(20);
        let s = spec(3);
        let mut st = St {
            results: vec![result(0, 3, true), result(1, 3, true)],
        };
        assert_eq!(
            assess_ring(&s, &st.results, false, true, t),
            RingOutcome::Waiting
        );
        match assess_ring(&s, &st.results, true, true, t) {
            RingOutcome::Failed {
                message,
                failed_pairs: 0,
            } => assert!(
                message.contains("timed out") && message.contains("n2"),
                "{message}"
            ),
            v => panic!("{v:?}"),
        }
        st.results.push(result(2, 3, true));
        match assess_ring(&s, &st.results, false, true, t) {
            RingOutcome::Passed(m) => {
                assert!(m.contains("3 pairs") && m.contains("12.0 µs"), "{m}")
            }
            v => panic!("{v:?}"),
        }
        st.results[1] = result(1, 3, false);
        match assess_ring(&s, &st.results, false, true, t) {
            RingOutcome::Failed {
                message,
                failed_pairs: 1,
            } => assert!(
                message.contains("n1 -> n2 (mlx5_0 port 1): timeout"),
                "{message}"
            ),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn unmeasured_rdma_counts_only_without_require_rdma() {
        let t = Duration::from_secs(20);
        let s = spec(2);
        let mut st = St {
            results: vec![result(0, 2, true), result(1, 2, true)],
        };
        st.results[0].rdma = Rdma::Unmeasured;
        assert!(matches!(
            assess_ring(&s, &st.results, false, true, t),
            RingOutcome::Failed {
                failed_pairs: 1,
                ..
            }
        ));
        match assess_ring(&s, &st.results, false, false, t) {
            RingOutcome::Passed(m) => assert!(m.contains("require_rdma is false"), "{m}"),
            v => panic!("{v:?}"),
        }
        // The wrong neighbour, or too little bandwidth, is a failed pair.
        st.results[0].rdma = Rdma::Measured;
        st.results[1].peer = "n1".into();
        assert!(matches!(
            assess_ring(&s, &st.results, false, true, t),
            RingOutcome::Failed {
                failed_pairs: 1,
                ..
            }
        ));
        let mut bw = spec(2);
        bw.min_bandwidth_gbps = Some(25.0);
        st.results[1].peer = "n0".into();
        st.results[0].bandwidth_gbps = Some(90.0);
        st.results[1].bandwidth_gbps = Some(9.5);
        match assess_ring(&bw, &st.results, false, true, t) {
            RingOutcome::Failed { message, .. } => assert!(message.contains("9.5 Gbit/s below 25")),
            v => panic!("{v:?}"),
        }
    }
}
