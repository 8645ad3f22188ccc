//! The responder's places: connections that have not authenticated yet wait in a small pool
//! of their own ([`MAX_HANDSHAKES`], [`MAX_HANDSHAKES_PER_SOURCE`], cut after
//! [`HANDSHAKE_TIMEOUT`]); only an authenticated client takes one of the [`MAX_SESSIONS`]
//! session slots. The source address of a live gang check's predecessor
//! ([`ExpectedPeers`]) has [`EXPECTED_PER_PEER`] handshake places beyond the pool, and as
//! many sessions beyond [`MAX_SESSIONS`], so strangers holding idle connections
//! cannot keep the one peer a check needs out.

use super::{
    EXPECTED_PER_PEER, MAX_EXPECTED_PEERS, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE,
    MAX_PER_SOURCE, MAX_SESSIONS,
};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Source addresses whose sessions a live gang check waits for, each until its deadline.
/// Cloned handles share one set.
#[derive(Clone, Debug, Default)]
pub struct ExpectedPeers(Arc<Mutex<HashMap<IpAddr, Instant>>>);

impl ExpectedPeers {
    /// Keep places for sessions from `source` until `until` (a later `until` extends it).
    /// At most [`MAX_EXPECTED_PEERS`] addresses are kept; beyond that, the one due soonest
    /// is dropped.
    pub fn expect(&self, source: IpAddr, until: Instant) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        map.retain(|_, u| *u > now);
        let entry = map.entry(source).or_insert(until);
        *entry = (*entry).max(until);
        while map.len() > MAX_EXPECTED_PEERS {
            let Some(first) = map.iter().min_by_key(|(_, u)| **u).map(|(ip, _)| *ip) else {
                break;
            };
            map.remove(&first);
        }
    }

    /// Whether `source` is expected now.
    pub fn is_expected(&self, source: IpAddr) -> bool {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&source).is_some_and(|u| *u > Instant::now())
    }
}

/// Places in use: per source, and in total.
#[derive(Default)]
struct Count {
    per_source: HashMap<IpAddr, usize>,
    total: usize,
}

impl Count {
    fn take(&mut self, source: IpAddr, per_source: usize, total: usize) -> bool {
        let mine = self.per_source.get(&source).copied().unwrap_or(0);
        if mine >= per_source || self.total >= total {
            return false;
        }
        self.per_source.insert(source, mine + 1);
        self.total += 1;
        true
    }

    fn give_back(&mut self, source: IpAddr) {
        if let Some(n) = self.per_source.get_mut(&source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_source.remove(&source);
            }
        }
        self.total = self.total.saturating_sub(1);
    }
}

/// Which pool a place was taken from.
#[derive(Clone, Copy)]
enum Pool {
    Handshakes,
    Reserved,
    Sessions,
    ExpectedSessions,
}

/// Every pool of one responder.
#[derive(Default)]
pub(super) struct Places {
    handshakes: Mutex<Count>,
    /// Handshakes of expected peers, beyond [`MAX_HANDSHAKES`].
    reserved: Mutex<Count>,
    sessions: Mutex<Count>,
    /// Sessions of expected peers beyond [`MAX_SESSIONS`].
    expected_sessions: Mutex<Count>,
    /// Authenticated sessions being served.
    active: AtomicUsize,
    /// Connections that have not authenticated yet.
    pending: AtomicUsize,
    pub(super) expected: ExpectedPeers,
}

impl Places {
    fn count(&self, pool: Pool) -> &Mutex<Count> {
        match pool {
            Pool::Handshakes => &self.handshakes,
            Pool::Reserved => &self.reserved,
            Pool::Sessions => &self.sessions,
            Pool::ExpectedSessions => &self.expected_sessions,
        }
    }

    fn try_take(self: &Arc<Self>, pool: Pool, source: IpAddr) -> Option<Place> {
        let (per_source, total) = match pool {
            Pool::Handshakes => (MAX_HANDSHAKES_PER_SOURCE, MAX_HANDSHAKES),
            Pool::Reserved => (EXPECTED_PER_PEER, EXPECTED_PER_PEER * MAX_EXPECTED_PEERS),
            Pool::Sessions => (MAX_PER_SOURCE, MAX_SESSIONS),
            Pool::ExpectedSessions => (EXPECTED_PER_PEER, EXPECTED_PER_PEER),
        };
        let taken = self
            .count(pool)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(source, per_source, total);
        if !taken {
            return None;
        }
        match pool {
            Pool::Handshakes | Pool::Reserved => self.pending.fetch_add(1, Ordering::AcqRel),
            Pool::Sessions | Pool::ExpectedSessions => self.active.fetch_add(1, Ordering::AcqRel),
        };
        Some(Place {
            places: Arc::clone(self),
            pool,
            source,
        })
    }

    /// A place to authenticate in for a new connection from `source`: the shared pool, or,
    /// for an expected peer, its reserved places first.
    pub(super) fn handshake(self: &Arc<Self>, source: IpAddr) -> Option<Place> {
        if self.expected.is_expected(source)
            && let Some(p) = self.try_take(Pool::Reserved, source)
        {
            return Some(p);
        }
        self.try_take(Pool::Handshakes, source)
    }

    /// A session slot for an authenticated client from `source`.
    pub(super) fn session(self: &Arc<Self>, source: IpAddr) -> Option<Place> {
        self.try_take(Pool::Sessions, source).or_else(|| {
            self.expected
                .is_expected(source)
                .then(|| self.try_take(Pool::ExpectedSessions, source))
                .flatten()
        })
    }

    pub(super) fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    pub(super) fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }
}

/// One place, given back however the connection ends.
pub(super) struct Place {
    places: Arc<Places>,
    pool: Pool,
    source: IpAddr,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places
            .count(self.pool)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .give_back(self.source);
        match self.pool {
            Pool::Handshakes | Pool::Reserved => self.places.pending.fetch_sub(1, Ordering::AcqRel),
            Pool::Sessions | Pool::ExpectedSessions => {
                self.places.active.fetch_sub(1, Ordering::AcqRel)
            }
        };
    }
}
