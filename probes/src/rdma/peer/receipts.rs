//! What a responder saw of the sessions of a gang check: the client names
//! the check in its HELLO ([`CheckTag`]), and the responder keeps, per session that
//! authenticated, who it was, the rail and what landed: a greeting only, bytes verified in its
//! own buffer, or the failure. The receiving node's agent reads them back ([`Receipts::of`])
//! and attests its end of the pair in its own answer, so that no pair is vouched for by the
//! sender alone.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Receipts kept (a node is in a few checks at a time, a few rails each); the oldest go first.
pub const MAX_RECEIPTS: usize = 512;

/// The gang check a session belongs to, and which of the client's rails it measures: told to
/// the responder in HELLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheckTag {
    /// The check's uid, as 16 bytes (all zero: no check).
    pub check: [u8; 16],
    /// This session's rail (0-based) of the client's `rails`.
    pub rail: u8,
    pub rails: u8,
}

impl CheckTag {
    /// The tag of rail `rail` of `rails` for the check whose uid is `uid` (a UUID in its text
    /// form); `None` for anything else.
    pub fn new(uid: &str, rail: u8, rails: u8) -> Option<Self> {
        let hex: Vec<u8> = uid.bytes().filter(|b| *b != b'-').collect();
        if hex.len() != 32 {
            return None;
        }
        let mut check = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).ok()?;
            check[i] = u8::from_str_radix(text, 16).ok()?;
        }
        (check != [0; 16]).then_some(Self { check, rail, rails })
    }
}

/// What the responder saw of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// The client authenticated and greeted (the side channel only: no RDMA asked).
    Greeted,
    /// The client's WRITEs landed: these bytes of the responder's buffer matched its digest.
    Verified { bytes: u64 },
    /// The session failed on the responder's side (why).
    Failed(String),
}

/// One session of a check, as the responder saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub tag: CheckTag,
    /// The client's node, as its authenticated HELLO named it.
    pub from: String,
    /// The responder's port that served it (empty when none did).
    pub device: String,
    pub port: u8,
    pub seen: Seen,
}

/// The responder's receipts, shared with its agent; cloned handles share one log.
#[derive(Clone, Debug, Default)]
pub struct Receipts(Arc<Mutex<VecDeque<Receipt>>>);

impl Receipts {
    pub(super) fn record(&self, receipt: Receipt) {
        if receipt.tag.check == [0; 16] {
            return;
        }
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() >= MAX_RECEIPTS {
            log.pop_front();
        }
        log.push_back(receipt);
    }

    /// The receipts of check `check` (its uid) from node `from`, oldest first.
    pub fn of(&self, check: &str, from: &str) -> Vec<Receipt> {
        let Some(tag) = CheckTag::new(check, 0, 0) else {
            return Vec::new();
        };
        let log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        log.iter()
            .filter(|r| r.tag.check == tag.check && r.from == from)
            .cloned()
            .collect()
    }
}
