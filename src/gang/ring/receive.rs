//! This node's receiving end of the pair its ring predecessor measures: a
//! pair's sender alone could vouch for a link it never used, so each member also attests, in
//! its own answer, what its responder saw of its predecessor's sessions for the check (the
//! responder's [`Receipts`]): bytes landed and verified in its buffer, an authenticated
//! greeting when there is no RDMA, or the failure. The controller requires both ends to agree.

use crate::gang::fabriccheck::{Rdma, Received, ReceivedRail};
use fabricgate_probes::rdma::peer::{Receipt, Receipts, Seen};
use std::time::{Duration, Instant};

/// How often the receipts are read while the predecessor's sessions are awaited.
const POLL: Duration = Duration::from_millis(50);

/// Pure: the receiving end attested by `receipts` (of `from`, for one check), and whether
/// nothing more is to come (every rail the predecessor announced ended). `ok` only when every
/// announced rail delivered.
pub(crate) fn received(from: &str, receipts: &[Receipt]) -> (Received, bool) {
    let rails: Vec<ReceivedRail> = receipts
        .iter()
        .map(|r| {
            let (ok, bytes, error) = match &r.seen {
                Seen::Greeted => (true, None, None),
                Seen::Verified { bytes } => (true, Some(*bytes), None),
                Seen::Failed(why) => (false, None, Some(why.clone())),
            };
            ReceivedRail {
                device: r.device.clone(),
                port: r.port,
                ok,
                bytes,
                error,
            }
        })
        .collect();
    let verified = receipts
        .iter()
        .any(|r| matches!(r.seen, Seen::Verified { .. }));
    // Every rail the predecessor announced, each ended, each delivered.
    let announced = receipts.iter().map(|r| r.tag.rails).max().unwrap_or(0);
    let ended = |ok: bool| {
        announced > 0
            && (0..announced).all(|i| {
                receipts
                    .iter()
                    .zip(&rails)
                    .any(|(r, rail)| r.tag.rail == i && (!ok || rail.ok))
            })
    };
    let done = ended(false);
    let ok = ended(true);
    let error = (!ok).then(|| match rails.iter().find_map(|r| r.error.clone()) {
        Some(why) => format!("{from}'s sessions failed here: {why}"),
        None if rails.is_empty() => format!("nothing received from {from} for this check"),
        None => format!(
            "{} of {announced} rails of {from}'s arrived",
            rails.iter().filter(|r| r.ok).count()
        ),
    });
    (
        Received {
            peer: from.to_owned(),
            ok,
            rdma: if verified {
                Rdma::Measured
            } else {
                Rdma::Unmeasured
            },
            rails,
            error,
        },
        done,
    )
}

/// Wait until the predecessor `from`'s sessions for check `uid` are all in (or `until`), and
/// attest them.
pub(crate) async fn wait(receipts: &Receipts, uid: &str, from: &str, until: Instant) -> Received {
    loop {
        let (r, done) = received(from, &receipts.of(uid, from));
        if done || Instant::now() >= until {
            return r;
        }
        tokio::time::sleep(POLL).await;
    }
}
